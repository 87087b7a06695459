"""The pipeline API: an operator writes only its compute closure; building the schedule and the handler
and walking them is done here, once.

    gather_and_consume(x_shard, consume, group, ctx, ring)   Flash-AG: consume(rows, x_slice) per arrived slice
    produce_and_scatter(producer, block, sums, group, ctx, ring)
                                            Flash-RS: producer.fn(rows) -> partial; -> own block [*block];
                                            sums kept in sums.acc, sent in sums.wire, returned in sums.out
    exchange(x, algo, group, ctx)           all-reduce on the P2P steps of schedules.allreduce
    walk(group, ctx, pass_a, pass_b, ...)   several passes in ONE merged walk, e.g.

        rs = scatter(producer_dx, block, sums, group, ctx, Ring(name="bwd.rs", tag=0))
        ag = gather(x_shard, consume_dw, group, ctx, Ring(name="bwd.ag", tag=1))
        walk(group, ctx, rs, ag)        # step i: RS hop i + AG hop i in flight, one dx and one dw slice

The options are objects (runtime/options.py): `ring` is what the transfers need (direction, sub-chunks per
hop, buffer name, tag), `producer` what the compute closure is, `sums` how partials add up.

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

from ..schedules import Schedule, Step, all_gather_ring, all_reduce_schedule, merge, reduce_scatter_ring, ring_tail
from .context import OverlapContext
from .executor import Deferred, execute
from .group import group_info
from .handlers import ExchangePass, GatherPass, ScatterPass, TailPass
from .options import AG, RS, Producer, Ring, Sums

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


def gather(x_shard: torch.Tensor, consume: Callable[[Rows, torch.Tensor], None], group, ctx: OverlapContext,
           ring: Ring = AG, *, keep_gathered: bool = False) -> Pass:
    """The Flash-AG pass of x_shard [s/P, ...]: local shard first; `handler.gathered` [s, ...] if kept.
    ring.hop_chunks: each hop cut in that many row sub-chunks, posted ahead, each consumed as it arrives."""
    rank, world = group_info(group)
    sched = schedule(all_gather_ring, rank, world, bidirectional=ring.bidirectional, chunks=ring.hop_chunks,
                     tag=ring.tag)
    return Pass(sched, GatherPass(x_shard, consume, sched, ctx, ring, keep_gathered))


def scatter(producer: Producer, block: tuple, sums: Sums, group, ctx: OverlapContext, ring: Ring = RS) -> Pass:
    """The Flash-RS pass of partials [block[0] * P, *block[1:]]: own block last; `handler.result()` [*block].
    ring.hop_chunks: each block made and sent in that many row sub-chunks (each sent as soon as it is made).
    Sums are kept in sums.acc and travel in sums.wire. producer.into: `fn(rows, out)` writes the partial into
    the ring slot `out` (sums.acc) instead of returning it. producer.own_into [*block] (sums.acc == sums.out):
    the own block is made, summed and returned there (no ring slot, no copy; with into, `fn` may be handed a
    view of it)."""
    own = producer.own_into
    if own is not None and (own.dtype != sums.acc or sums.acc != sums.out):
        raise ValueError(f"scatter: own_into is {own.dtype}; it holds the sum, so the acc dtype ({sums.acc}) and "
                         f"the out dtype ({sums.out}) must both be its dtype")
    rank, world = group_info(group)
    sched = schedule(reduce_scatter_ring, rank, world, bidirectional=ring.bidirectional, chunks=ring.hop_chunks,
                     tag=ring.tag)
    return Pass(sched, ScatterPass(producer, block, sums, sched, ctx, ring))


def tail(pieces: int, fn: Callable[[int], None], group, *, tag: int) -> Pass | None:
    """Compute-only pass: pieces 0..n-1 of `fn`, spread over the P-1 hop steps of a ring it is merged with."""
    if pieces == 0:
        return None
    rank, world = group_info(group)
    return Pass(schedule(ring_tail, rank, world, pieces=pieces, tag=tag), TailPass(fn, tag))


def gather_and_consume(x_shard: torch.Tensor, consume: Callable[[Rows, torch.Tensor], None], group,
                       ctx: OverlapContext, ring: Ring = AG, *, keep_gathered: bool = False) -> torch.Tensor | None:
    """Flash-AG of x_shard [s/P, ...], each slice consumed as it arrives. -> AG(x) [s, ...] if kept, else None."""
    p = gather(x_shard, consume, group, ctx, ring, keep_gathered=keep_gathered)
    walk(group, ctx, p)
    return p.handler.gathered


def produce_and_scatter(producer: Producer, block: tuple, sums: Sums, group, ctx: OverlapContext,
                        ring: Ring = RS, *, defer_last: bool = False):
    """Flash-RS: producer.fn(rows) -> partial [rows, *block[1:]] (or written into the ring slot: `scatter`),
    summed over the group in sums.acc, sent in sums.wire. -> this rank's block [*block] in sums.out
    (producer.own_into: that tensor, the sum made in it); defer_last: -> finish, a callable that waits on the
    last hop and returns that block (every GEMM slice has run; the ring's buffers in ctx stay in use until
    finish: runtime/executor.py)."""
    p = scatter(producer, block, sums, group, ctx, ring)
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
