"""The communication thread of a host-driven transport: the CPU analogue of NCCL's stream.

gloo posts a point-to-point transfer in the calling thread (a 512 KiB hop blocks it ~1.5 ms at 4 gbit/s),
so a post from the compute thread runs serially with the GEMM slice it should overlap. Here every post
of a process runs on ONE worker thread, in submission order (a FIFO queue: the order of transfers to
each peer is the program's order, as on a stream), while the compute thread goes on to its slice:

    compute thread | submit(step i) | GEMM slice i ............ | wait(i) | submit(i+1) | ...
    comm thread    |                | post sends/recvs of i    |          |              | post i+1 ...

    threaded()                              False while torch's profiler or a dispatch mode is active in the
                                            caller: posts stay in the caller
    comm_thread().submit(fn) -> Pending     fn() runs on the thread; Pending.result(seconds) -> its value,
                                            or re-raises its exception in the caller; None if not done

The thread is a daemon, started on first use in each process (a forked worker starts its own).
"""
from __future__ import annotations

import os
import queue
import threading
from typing import Callable

import torch



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
    """One daemon thread running submitted jobs in FIFO order."""

    def __init__(self):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="flashoverlap-comm", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            pending, fn = self._jobs.get()
            pending._run(fn)

    def submit(self, fn: Callable[[], object]) -> Pending:
        p = Pending()
        self._jobs.put((p, fn))
        return p


def threaded() -> bool:
    """Whether posts go to the thread: not while torch's profiler runs in the caller (it records the calling
    thread only, so c10d op counts and traces would lose every transfer), and not while a TorchDispatchMode is
    active in the caller (modes are thread-local: a mode that watches or rewrites the c10d ops, a counter, a
    fake-tensor or tracing mode, would never see the posts); the transfers are the same either way."""
    return not torch.autograd._profiler_enabled() and torch._C._len_torch_dispatch_stack() == 0


_THREAD: dict[int, CommThread] = {}  # pid -> this process's thread (a fork does not inherit threads)


def comm_thread() -> CommThread:
    """This process's communication thread, started on first use."""
    pid = os.getpid()
    t = _THREAD.get(pid)
    if t is None:
        _THREAD.clear()
        t = _THREAD[pid] = CommThread()
    return t
