"""The fused DP ring off the compute thread, on host-driven transports (gloo): its wait no longer blocks backward.

A fused weight's ring (ops/dp/wgrad_rs.py) waits on every hop. Run in the compute thread, it hides under
that weight's own wgrad GEMM and, its last hop being waited at the next fused ring (megatron/ddp/grad_sync.py), under
the backward up to that ring; a ring longer than that (or hops before the last longer than their GEMM
slices, P > 2) stalls the backward. Here, on a
"timed" transport (gloo: the host moves the bytes, runtime/transport.py), the ring, its GEMM slices
included, runs on ONE DP worker thread per process, FIFO (so every rank runs the rings in backward
order, and each ring's hops keep program order), while the compute thread goes on with the backward of
the layers before it:

    compute | layer 3 dgrad | layer 2 dgrad+wgrad ........ | layer 1 ...... | layer 0 | finish_grad_sync: wait
    worker  |               | ring of layer 3 (GEMM slices, hops) | ring of layer 2 ... | ring 1 | ring 0 |

`finish_grad_sync` waits on the ring's handle (Megatron's own wait), then judges the local gradient norm
(the NaN / large-gradient check, in the compute thread, as stock). On "stream" transports (NCCL) the ring
stays on the current stream: its waits are stream-ordered and never block the host (a side stream would
let it overlap the next layers' GEMMs on the device too; not done here).

On host-driven transports, asynchronous=None: the worker, except at TP = 1 where the automatic choice's cost
model finds that rings in backward do not stall it (auto_fuse.auto_linears, with its measurements;
plan/dp.worker_pays); asynchronous=False keeps each ring inside its layer's backward, True forces the
worker. At TP > 1
the worker's DP rings and backward's TP rings post
from two threads at once: each group has its own FIFO communication thread (runtime/commthread.py), so
neither ring's posts queue behind the other's. The worker runs its rings under torch.no_grad(): grad mode is per
thread, and without it a TP2xDP2 + SP step raised on a rank, leaving its peers waiting in stock collectives.

The ring's shape check runs in the compute thread before the job is queued (a collective on the DP group
issued in program order, like Megatron's own bucket collectives); the worker's ring runs with a context
that does not check again. Its operands (dy, the gathered x) stay alive until the ring has run.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from ...runtime import transport_kind
from ...runtime.commthread import CommThread

_WORKER: dict[int, CommThread] = {}  # pid -> this process's DP worker (a fork does not inherit threads)


def runs_async(group, device_type: str) -> bool:
    """The default (asynchronous=None): the worker on host-driven ("timed") transports, where the host moves
    the bytes and a wait holds the backward; False on stream-ordered ones (NCCL: the ring's waits are
    stream-ordered already, module docstring)."""
    return transport_kind(dist.get_backend(group), device_type) == "timed"


def check_async(group, device_type: str) -> None:
    """asynchronous=True is for host-driven transports (module docstring)."""
    if transport_kind(dist.get_backend(group), device_type) != "timed":
        raise ValueError("flash DP overlap: asynchronous=True runs the ring on a host thread, for host-driven "
                         "transports (gloo); on NCCL the ring is already stream-ordered: leave it None/False")


def worker() -> CommThread:
    """This process's DP worker thread, started on first use."""
    pid = os.getpid()
    if pid not in _WORKER:
        _WORKER.clear()
        _WORKER[pid] = CommThread()
    return _WORKER[pid]


def no_grad(fn):
    """fn run without autograd recording (grad mode is per thread: the worker's is on, backward's is off)."""
    def run():
        with torch.no_grad():
            return fn()
    return run


class RingHandle:
    """Megatron's communication handle for a bucket whose ring runs on the worker: wait() joins the ring
    (re-raising its error here) and then runs the local-gradient check."""

    def __init__(self, pending, on_done):
        self._pending, self._on_done = pending, on_done

    def wait(self, *args, **kwargs) -> None:
        self._pending.result(None)  # the ring's own hops are timed: a dead peer raises inside it
        self._on_done()
