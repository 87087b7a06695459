"""The pipeline API: an operator writes only its compute closure; building the schedule and the handler
and walking them is done here, once.

    gather_and_consume(x_shard, consume, group, ctx)   Flash-AG: consume(rows, x_slice) per arrived slice
    produce_and_scatter(produce, block_rows, tail, group, ctx, acc_dtype=, out_dtype=, device=, wire_dtype=)
                                                       Flash-RS: produce(rows) -> partial; -> own block;
                                                       sums kept in acc_dtype, sent in wire_dtype
                                                       (None: out_dtype, stock's bytes)
    exchange(x, algo, group, ctx)                      all-reduce on the P2P steps of schedules.allreduce
    walk(group, ctx, pass_a, pass_b, ...)              several passes in ONE merged walk, e.g.

        rs = scatter(produce_dx, ..., tag=0); ag = gather(x_shard, consume_dw, ..., tag=1)
        walk(group, ctx, rs, ag)        # step i: RS hop i + AG hop i in flight, one dx and one dw slice

`gather`, `scatter` and `tail` build the passes (a schedule of one rank + its data-side handler) that
`walk` merges; rows are (start, stop) of the gathered / pre-scatter dim 0. The all-to-all pipeline
functions (`produce_all_to_all`, `consume_all_to_all`) live in runtime/alltoall.py.

Schedules are pure data: `schedule(builder, rank, world, ...)` builds each one once per arguments and
`merged(...)` merges each combination once, so a steady-state walk builds no step objects.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch

from ..schedules import Schedule, Slice, Step, all_gather_ring, all_reduce_schedule, merge, reduce_scatter_ring
from .context import OverlapContext
from .executor import Deferred, execute
from .group import group_info
from .handlers import ExchangePass, GatherPass, ScatterPass, TailPass

Rows = tuple[int, int]


@dataclass(frozen=True)
class Pass:
    """One collective of a walk: this rank's schedule and the handler that owns its tensors."""

    schedule: Schedule
    handler: object


_MERGED: dict = {}
_MAX_MERGED = 1024  # merged step lists kept; past that the cache starts over


@functools.lru_cache(maxsize=1024)
def schedule(builder: Callable[..., Schedule], rank: int, world: int, **kw) -> Schedule:
    """builder(rank, world, **kw), built once per arguments (a schedule is immutable data)."""
    return builder(rank, world, **kw)


def merged(*schedules: Schedule) -> tuple[Step, ...]:
    """merge(*schedules), once per combination of schedule objects (the entry keeps them alive)."""
    if len(schedules) == 1:
        return schedules[0].steps
    key = tuple(map(id, schedules))
    hit = _MERGED.get(key)
    if hit is None or any(a is not b for a, b in zip(hit[0], schedules)):
        if len(_MERGED) >= _MAX_MERGED:
            _MERGED.clear()
        hit = _MERGED[key] = (schedules, merge(*schedules))
    return hit[1]


def walk(group, ctx: OverlapContext, *passes: Pass | None, defer_last: bool = False) -> Deferred | None:
    """Run the passes in ONE executor walk: schedules merged step by step (None entries skipped).
    defer_last: the last step's waits come back as a Deferred (runtime/executor.py)."""
    passes = [p for p in passes if p is not None]
    if not passes:
        return Deferred() if defer_last else None
    handlers = {p.handler.tag: p.handler for p in passes}
    if len(handlers) != len(passes):
        raise ValueError(f"walk: passes share a tag {[p.handler.tag for p in passes]}; give each pass of one "
                         f"walk its own tag=")
    return execute(merged(*(p.schedule for p in passes)), group, handlers, ctx, defer_last=defer_last)


def gather(x_shard: torch.Tensor, consume: Callable[[Rows, torch.Tensor], None], group, ctx: OverlapContext, *,
           bidirectional: bool = False, keep_gathered: bool = False, name: str = "ag", tag: int = 0,
           hop_chunks: int = 1) -> Pass:
    """The Flash-AG pass of x_shard [s/P, ...]: local shard first; `handler.gathered` [s, ...] if kept.
    hop_chunks: each hop cut in that many row sub-chunks, posted ahead, each consumed as it arrives."""
    rank, world = group_info(group)
    sched = schedule(all_gather_ring, rank, world, bidirectional=bidirectional, chunks=hop_chunks, tag=tag)
    return Pass(sched, GatherPass(x_shard, rank, world, sched.parts, consume, ctx, keep_gathered, name, tag))


def scatter(produce: Callable[[Rows], torch.Tensor], block_rows: int, tail_shape: tuple, group,
            ctx: OverlapContext, *, acc_dtype: torch.dtype, out_dtype: torch.dtype, device,
            wire_dtype: torch.dtype | None = None, bidirectional: bool = False, name: str = "rs",
            tag: int = 0, into: bool = False, hop_chunks: int = 1, own_into: torch.Tensor | None = None) -> Pass:
    """The Flash-RS pass of partials [block_rows * P, *tail_shape]: own block last; `handler.result()`.
    hop_chunks: each block made and sent in that many row sub-chunks (each sent as soon as it is made).
    Sums are kept in acc_dtype and travel in wire_dtype (None: out_dtype, the bytes of stock's collective).
    into: `produce(rows, out)` writes the partial into the ring slot `out` (acc_dtype) instead of returning it.
    own_into [block_rows, *tail_shape] (acc_dtype == out_dtype): the own block is made, summed and returned
    there (no ring slot, no copy; with into=True, `produce` may be handed a view of it)."""
    if own_into is not None and (own_into.dtype != acc_dtype or acc_dtype != out_dtype):
        raise ValueError(f"scatter: own_into is {own_into.dtype}; it holds the sum, so acc_dtype ({acc_dtype}) and "
                         f"out_dtype ({out_dtype}) must both be its dtype")
    rank, world = group_info(group)
    sched = schedule(reduce_scatter_ring, rank, world, bidirectional=bidirectional, chunks=hop_chunks, tag=tag)
    handler = ScatterPass(block_rows, rank, sched.parts, produce, tail_shape, acc_dtype, out_dtype, device, ctx,
                          name, tag, into, wire_dtype, own_into)
    return Pass(sched, handler)


def tail(pieces: int, fn: Callable[[int], None], group, *, tag: int) -> Pass | None:
    """Compute-only pass: pieces 0..n-1 of `fn`, spread over the P-1 hop steps of a ring it is merged with."""
    if pieces == 0:
        return None
    rank, world = group_info(group)
    return Pass(schedule(_tail_schedule, rank, world, pieces=pieces, tag=tag), TailPass(fn, tag))


def _tail_schedule(rank: int, world: int, *, pieces: int, tag: int) -> Schedule:
    hops = max(world - 1, 1)
    steps = tuple(Step(compute=tuple(Slice(i, 0, tag) for i in range(pieces) if i % hops == s)) for s in range(hops))
    return Schedule("produce", rank, world, steps, name="tail")


def gather_and_consume(x_shard: torch.Tensor, consume: Callable[[Rows, torch.Tensor], None], group,
                       ctx: OverlapContext, *, bidirectional: bool = False, keep_gathered: bool = False,
                       name: str = "ag", hop_chunks: int = 1) -> torch.Tensor | None:
    """Flash-AG of x_shard [s/P, ...], each slice consumed as it arrives. -> AG(x) [s, ...] if kept, else None."""
    p = gather(x_shard, consume, group, ctx, bidirectional=bidirectional, keep_gathered=keep_gathered, name=name,
               hop_chunks=hop_chunks)
    walk(group, ctx, p)
    return p.handler.gathered


def produce_and_scatter(produce: Callable[[Rows], torch.Tensor], block_rows: int, tail_shape: tuple, group,
                        ctx: OverlapContext, *, acc_dtype: torch.dtype, out_dtype: torch.dtype, device,
                        wire_dtype: torch.dtype | None = None, bidirectional: bool = False,
                        name: str = "rs", into: bool = False, hop_chunks: int = 1, defer_last: bool = False,
                        own_into: torch.Tensor | None = None):
    """Flash-RS: produce(rows) -> partial [rows, *tail_shape] (into: produce(rows, out) fills it), summed over
    the group in acc_dtype, sent in wire_dtype (None: out_dtype). -> this rank's block [block_rows, *tail_shape]
    in out_dtype (own_into: that tensor, the sum made in it: `scatter`); defer_last: -> finish, a callable
    that waits on the last hop and returns that block (every GEMM slice has run; the ring's buffers in ctx
    stay in use until finish: runtime/executor.py)."""
    p = scatter(produce, block_rows, tail_shape, group, ctx, acc_dtype=acc_dtype, out_dtype=out_dtype,
                device=device, wire_dtype=wire_dtype, bidirectional=bidirectional, name=name, into=into,
                hop_chunks=hop_chunks, own_into=own_into)
    pending = walk(group, ctx, p, defer_last=defer_last)
    if not defer_last:
        return p.handler.result()

    def finish() -> torch.Tensor:
        pending.finish()
        return p.handler.result()
    return finish


_all_reduce_schedule = functools.lru_cache(maxsize=256)(all_reduce_schedule)  # pure data: once per layout


def exchange(x: torch.Tensor, algo: str, group, ctx: OverlapContext, *, local_world_size: int | None = None,
             name: str = "ar") -> torch.Tensor:
    """x [*] summed over the group on the P2P steps of schedules.all_reduce_schedule(algo) -> out [*].

    The message is flattened and zero-padded to a multiple of the schedule's block count (zeros add nothing)."""
    rank, world = group_info(group)
    sched = _all_reduce_schedule(algo, rank, world, local_world_size)
    blocks, n = len(sched.final), x.numel()
    flat = torch.empty(-(-n // blocks) * blocks, dtype=x.dtype, device=x.device)  # [blocks * size]
    flat[:n].copy_(x.reshape(-1))
    flat[n:].zero_()
    execute(sched.steps, group, {0: ExchangePass(flat, blocks, ctx, name)}, ctx)
    return flat[:n].view(x.shape)
