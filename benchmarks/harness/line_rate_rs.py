"""Stock's reduce-scatter at line rate on gloo: the benchmarks' baselines move the bytes NCCL's would.

gloo has no reduce-scatter of its own: torch runs reduce_scatter_tensor / reduce_scatter_single on gloo as an
all-reduce and keeps this rank's chunk (pytorch PR #118911), so each rank moves 2 (P-1)/P of the tensor where
NCCL's ring moves (P-1)/P. Measured (1gbit tbf loopback, 16M fp32 elements, min of 3, 2026-12-01):

    P   reduce_scatter_tensor   P2P ring (this module's algorithm)   all_gather_into_tensor (line rate)
    2   1102 ms                 550 ms                               531 ms
    4   3265 ms                 1589 ms                              1548 ms

A stock baseline paying gloo's 2x is slower than its idea allows, so the benchmarks run stock's
reduce-scatters as the ring NCCL would run: the Flash-RS ring of runtime.produce_and_scatter with a copy
for its producer (no GEMM), summed in the tensor's own dtype as gloo's is:

    with line_rate_reduce_scatter():    # in every rank, before the first collective it should cover
        ...                             # reduce-scatters on gloo groups run as P2P rings
    with stock_reduce_scatter(mode):    # a benchmark's --stock-rs: "ring" (the above) or "gloo" (torch's own)

    sync call      the ring runs on the group's shim thread; the caller waits for it
    async_op=True  the same thread; the returned handle's wait() joins it (a timed wait: a dead peer
                   raises there, runtime/transport.py). Inside torch's _coalescing_manager (Megatron's
                   bucket groups) the handles join the manager's: its cm.wait() waits them too.
    threads        a call from Megatron's gradient buffer (the DP buckets) runs on the DP worker
                   (megatron/ddp/worker.worker()), the FIFO our fused DP rings use: every rank then posts
                   the DP group's rings in one order. Every other call runs on its group's own FIFO thread.

Patched while installed (restored on exit): torch.distributed.reduce_scatter_tensor / reduce_scatter_single
(read at call time by runtime.group.reduce_scatter_into and by torch itself), and the names Megatron-Core
bound at import: `dist_reduce_scatter_func` in distributed.param_and_grad_buffer, tensor_parallel.mappings
and tensor_parallel.layers, and `_coalescing_manager` in param_and_grad_buffer. Other backends, reduce ops
other than SUM / AVG and non-contiguous outputs go to torch's function unchanged. Benchmarks only: the
tests run torch's own collectives.
"""
from __future__ import annotations

import contextlib
import threading
import weakref

import torch
import torch.distributed as dist

from megatron_flashoverlap.megatron.ddp import worker as dp_worker
from megatron_flashoverlap.runtime import (OverlapContext, Producer, Ring, Sums, default_context, group_info,
                                        produce_and_scatter, shared_context)
from megatron_flashoverlap.runtime.commthread import CommThread

_ORIG = {"reduce_scatter_tensor": dist.reduce_scatter_tensor, "reduce_scatter_single": dist.reduce_scatter_single}
_OPEN = threading.local()  # .stack: the handle lists of the open coalescing managers of this thread
_THREADS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # group -> (CommThread, its context)
CALLS = {"dp_bucket": 0, "other": 0}  # reduce-scatters run as rings in this process (benchmarks report them)


def ring_reduce_scatter(output: torch.Tensor, inp: torch.Tensor, group, ctx: OverlapContext,
                        average: bool = False) -> None:
    """output [n/P] (any shape of that size) <- the sum (average) over `group` of inp [n] split along its
    flat order (= dim 0 of a contiguous tensor); own block last, one hop per block, no GEMM."""
    rank, world = group_info(group)
    flat_in = inp.reshape(-1)
    shard = flat_in.numel() // world
    if flat_in.numel() % world or output.numel() != shard:
        raise ValueError(f"line-rate reduce-scatter: input of {flat_in.numel()} elements over {world} ranks "
                         f"needs an output of {flat_in.numel() // world} elements divisible evenly; got "
                         f"{output.numel()}")

    def produce(span, out):
        out.copy_(flat_in[span[0]:span[1]])

    sums = Sums(inp.dtype, inp.dtype, inp.dtype, inp.device)  # summed, sent and returned in the input dtype
    own = produce_and_scatter(Producer(produce, into=True), (shard,), sums, group, ctx, Ring(name="stock.rs"))
    if average:
        own.div_(world)
    output.view(-1).copy_(own)


class Handle:
    """torch's Work for a ring on a shim thread: wait() joins it (re-raising its error here)."""

    def __init__(self, pending):
        self._pending = pending

    def wait(self, *args, **kwargs) -> bool:
        self._pending.result(None)  # the ring's own hops are timed: a dead peer raises inside it
        return True

    def is_completed(self) -> bool:
        return self._pending._done.is_set()


def _seconds(timeout):
    return None if timeout is None else timeout.total_seconds()


def _thread(group, dp_bucket: bool):
    """(thread, context) of a ring on `group` (module docstring: threads)."""
    if dp_bucket:  # the worker's own context, as its fused rings use (one thread: never two rings at once)
        return dp_worker.worker(), shared_context("worker", _seconds(default_context().timeout))
    if group not in _THREADS:
        _THREADS[group] = (CommThread("flashoverlap-stock-rs"), OverlapContext(check_peers="never"))
    return _THREADS[group]


def _covers(output, op, group) -> bool:
    return (dist.get_backend(group) == "gloo" and output.is_contiguous()
            and op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG))


def _make(orig, dp_bucket: bool = False):
    """A reduce_scatter_tensor with torch's signature that runs the ring where _covers() holds."""

    def reduce_scatter(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):  # noqa: A002
        group = group if group is not None else dist.group.WORLD
        if not _covers(output, op, group):
            return orig(output, input, op=op, group=group, async_op=async_op)
        thread, ctx = _thread(group, dp_bucket)
        CALLS["dp_bucket" if dp_bucket else "other"] += 1
        average = op == dist.ReduceOp.AVG
        src = input.contiguous()

        handle = Handle(thread.submit(dp_worker.no_grad(  # grad mode is per thread; a collective records nothing
            lambda: ring_reduce_scatter(output, src, group, ctx, average))))
        if not async_op:
            handle.wait()
            return None
        stack = getattr(_OPEN, "stack", None)
        if stack:
            stack[-1].append(handle)
        return handle

    return reduce_scatter


def _coalescing(orig):
    """torch's _coalescing_manager, whose manager also waits the shim's handles made inside it."""

    @contextlib.contextmanager
    def manager(group=None, device=None, async_ops=False):
        mine: list = []
        stack = _OPEN.__dict__.setdefault("stack", [])
        stack.append(mine)
        try:
            with orig(group, device, async_ops) as cm:
                yield cm
        finally:
            stack.pop()
        for h in mine:
            if async_ops:
                cm.append(h)
            else:
                h.wait()

    return manager


def _megatron_modules():
    from megatron.core.distributed import param_and_grad_buffer as pgb
    from megatron.core.tensor_parallel import layers, mappings
    return pgb, mappings, layers


MODES = ("ring", "gloo")  # the benchmarks' --stock-rs words


def stock_reduce_scatter(mode: str):
    """The benchmarks' --stock-rs: "ring" = line_rate_reduce_scatter(), "gloo" = torch's own collectives."""
    if mode not in MODES:
        raise ValueError(f"--stock-rs {mode!r}: choose among {MODES}")
    return line_rate_reduce_scatter() if mode == "ring" else contextlib.nullcontext()


@contextlib.contextmanager
def line_rate_reduce_scatter():
    """Stock's reduce-scatters on gloo groups run as P2P rings while inside (module docstring)."""
    pgb, mappings, layers = _megatron_modules()
    saved = [(dist, name, getattr(dist, name)) for name in _ORIG]
    saved += [(m, "dist_reduce_scatter_func", m.dist_reduce_scatter_func) for m in (pgb, mappings, layers)]
    saved.append((pgb, "_coalescing_manager", pgb._coalescing_manager))
    try:
        ring_single = _make(_ORIG["reduce_scatter_single"])
        dist.reduce_scatter_single = ring_single
        dist.reduce_scatter_tensor = ring_single
        pgb.dist_reduce_scatter_func = _make(pgb.dist_reduce_scatter_func, dp_bucket=True)
        mappings.dist_reduce_scatter_func = _make(mappings.dist_reduce_scatter_func)
        layers.dist_reduce_scatter_func = _make(layers.dist_reduce_scatter_func)
        pgb._coalescing_manager = _coalescing(pgb._coalescing_manager)
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)
