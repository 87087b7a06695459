"""The communication threads of a host-driven transport: the CPU analogue of NCCL's streams.

gloo posts a point-to-point transfer in the calling thread (the post returns once the socket took the bytes),
so a post from the compute thread runs serially with the GEMM slice it should overlap. Here the posts of
each process group run on that group's worker thread, in submission order (a FIFO queue per group: the
order of transfers to each peer within a group is the program's order, as on a stream; point-to-point
transfers only match within their group), while the compute thread goes on to its slice:

    compute thread | submit(step i) | GEMM slice i ............ | wait(i) | submit(i+1) | ...
    comm thread    |                | post sends/recvs of i    |          |              | post i+1 ...

One FIFO per group, not per process: the TP rings of the compute thread and the DP rings of the DP worker
(megatron/ddp/worker.py) post from two threads at once; on one shared queue a post of one group would
wait behind every queued post of the other (head-of-line coupling of two independent rings).

    threaded()                              False while torch's profiler or a dispatch mode is active in the
                                            caller: posts stay in the caller
    comm_thread(group=None).submit(fn)      fn() runs on `group`'s thread (None: the process's default one)
        -> Pending                          Pending.result(seconds) -> its value, or re-raises its exception
                                            in the caller; None if not done

Each thread is a daemon, started on first use of its group in each process (a forked worker starts its
own); it ends once its group is garbage (the table holds groups weakly) and its queue is drained, or at
interpreter exit: an atexit hook stops and joins every thread of the process BEFORE finalization. Without
it a daemon thread still alive at finalization (woken by a late put, or freeing its last job's tensors)
re-takes the GIL inside a tensor's C++ destructor, CPython ends the thread with pthread_exit, and the forced
unwind through that noexcept destructor aborts the process ("terminate called without an active
exception", core dump: THPVariable_dealloc -> decref_pyobject -> take_gil -> PyThread_exit_thread). An idle
thread also holds no job: its last closure (and the tensors it captured) is dropped as soon as it has run.
"""
from __future__ import annotations

import atexit
import os
import queue
import sys
import threading
import weakref
from typing import Callable

import torch

_STOP = object()  # the sentinel that ends a thread whose group is gone, or every thread at exit
_EXIT_JOIN_S = 30.0  # each job is timed (runtime/transport.py), so a thread ends within its job's timeout
_LIVE: list = []  # (pid, queue, thread) of every thread started; a forked child acts on its own pid's only


class Pending:
    """The outcome of one submitted job: its value or its exception, once the thread has run it."""

    __slots__ = ("_done", "_value", "_error")

    def __init__(self):
        self._done, self._value, self._error = threading.Event(), None, None

    def _run(self, fn: Callable[[], object]) -> None:
        try:
            self._value = fn()
        except BaseException as e:  # noqa: BLE001  (handed to the waiting thread, re-raised there)
            self._error = e
        self._done.set()

    def result(self, seconds: float | None):
        """fn()'s value (its exception re-raised here); None when it did not finish within `seconds`."""
        if not self._done.wait(seconds):
            return None
        if self._error is not None:
            raise self._error
        return self._value


class CommThread:
    """One daemon thread running submitted jobs in FIFO order (it ends when this object is garbage)."""

    def __init__(self, name: str = "flashoverlap-comm"):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        thread = threading.Thread(target=_loop, args=(self._jobs,), name=name, daemon=True)
        thread.start()
        _LIVE[:] = [e for e in _LIVE if e[2].is_alive()] + [(os.getpid(), self._jobs, thread)]
        weakref.finalize(self, self._jobs.put, (None, _STOP))  # the thread holds the queue, not self

    def submit(self, fn: Callable[[], object]) -> Pending:
        p = Pending()
        self._jobs.put((p, fn))
        return p


def _loop(jobs: queue.SimpleQueue) -> None:
    while True:
        pending, fn = jobs.get()
        if fn is _STOP:
            return
        pending._run(fn)
        del pending, fn  # an idle thread holds no job: its tensors are freed now, not at finalization


@atexit.register
def _stop_all() -> None:
    """Stop and join this process's threads while the interpreter still runs them (module docstring)."""
    pid = os.getpid()
    mine = [(q, t) for p, q, t in _LIVE if p == pid and t.is_alive()]
    for q, _ in mine:
        q.put((None, _STOP))
    for _, t in mine:
        t.join(_EXIT_JOIN_S)
        if t.is_alive():
            print(f"flashoverlap: communication thread {t.name} did not end within {_EXIT_JOIN_S:.0f} s at exit "
                  "(a transfer still running); the process may abort while finalizing", file=sys.stderr)
    _LIVE[:] = [e for e in _LIVE if e[2].is_alive()]


def threaded() -> bool:
    """Whether posts go to the thread: not while torch's profiler runs in the caller (it records the calling
    thread only, so c10d op counts and traces would lose every transfer), and not while a TorchDispatchMode is
    active in the caller (modes are thread-local: a mode that watches or rewrites the c10d ops, a counter, a
    fake-tensor or tracing mode, would never see the posts); the transfers are the same either way."""
    return not torch.autograd._profiler_enabled() and torch._C._len_torch_dispatch_stack() == 0


_TABLE: dict = {}  # pid -> (default thread, {group: its thread}, weak on the group); a fork does not inherit


def comm_thread(group=None) -> CommThread:
    """The communication thread of `group` (any process group object; None: this process's default one),
    started on first use."""
    pid = os.getpid()
    entry = _TABLE.get(pid)
    if entry is None:
        _TABLE.clear()
        entry = _TABLE[pid] = [None, weakref.WeakKeyDictionary()]
    if group is None:
        if entry[0] is None:
            entry[0] = CommThread()
        return entry[0]
    t = entry[1].get(group)
    if t is None:
        t = entry[1][group] = CommThread(f"flashoverlap-comm-{id(group):x}")
    return t
