"""The data-parallel gradient reduce-scatter at the end of a step: stock buckets, or fused into the wgrad GEMMs.

The last micro-batch's backward on the first pipeline stage is walked as a step list (one compute slice per
parameter, in backward order: per layer fc2, fc1, attention, proj, qkv, the norms; then the embedding):

    stock  Megatron DDP with --overlap-grad-reduce and the distributed optimizer: parameters fill buckets of
           max(40M, 1M x dp) elements in backward order (distributed_data_parallel.py); a bucket's reduce-scatter
           (fp32 gradients) is posted when its last gradient is ready; they run one after another; whatever is
           still running when the backward ends is exposed (the last bucket: the first layers and the embedding)
    fused  dp.fuse: the TP linears' weights (qkv, proj, fc1, fc2) leave the buckets; each one's wgrad GEMM runs
           inside its own DP ring (collectives.dp_ring: schedules.reduce_scatter_ring over DP, shard by shard,
           own shard last), so the slice of that parameter costs the ring walk instead of the whole wgrad
The exposed time is the walk's end minus the end of its compute; the backward's own growth (contention, a ring
longer than the GEMM it hides under) is `extra`.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..schedules import Slice, Step, Transfer
from . import steps as B
from .collectives import dp_ring
from .links import Group
from .price import ACC_BYTES, Env, Side, prices, walk_clock

BUCKET_MIN, BUCKET_PER_RANK = 40_000_000, 1_000_000  # Megatron DDP's default bucket size: max(40M, 1M x dp)


@dataclass(frozen=True)
class Param:
    """One parameter of the backward: `numel` elements on this rank, `compute` seconds of backward before its
    gradient is ready (after the previous one's), `ring`: (rows, tokens, k) of its wgrad if it can be fused."""

    name: str
    numel: int
    compute: float
    ring: tuple | None = None
    wgrad: float = 0.0  # seconds of its whole wgrad GEMM (inside `compute`)


@dataclass(frozen=True)
class DpTimes:
    exposed: float
    extra: float  # backward time added over the parameters' own compute (contention, rings)


def _buckets(params: list[Param], skip: set[int], dp: int) -> list[list[int]]:
    size, out, filled = max(BUCKET_MIN, BUCKET_PER_RANK * dp), [[]], 0
    for i, p in enumerate(params):
        if i in skip:
            continue
        out[-1].append(i)
        filled += p.numel
        if filled >= size:
            out.append([])
            filled = 0
    return [b for b in out if b]


def _steps(params: list[Param], buckets: list[list[int]]) -> tuple[Step, ...]:
    last = len(params)
    closes = {b[-1]: j for j, b in enumerate(buckets)}
    steps = []
    for i in range(last + 1):
        post = () if i == 0 or (i - 1) not in closes else (Transfer(B.NO_PEER, Slice(closes[i - 1], 0, B.COLL),
                                                                         lag=last - i),)
        steps.append(Step(sends=post, compute=(Slice(i, 0, 0),) if i < last else ()))
    return tuple(steps)


def sync(env: Env, g: Group, params: list[Param], fused: bool) -> DpTimes:
    """The DP reduce-scatter of one backward (module docstring); `fused`: every parameter with a ring fuses."""
    if g.size == 1:
        return DpTimes(0.0, 0.0)
    skip = {i for i, p in enumerate(params) if fused and p.ring is not None}
    rings: dict = {}  # identical layers: one walk per weight shape
    for i in skip:
        if params[i].ring not in rings:
            rings[params[i].ring] = dp_ring(env, g, *params[i].ring)[0]
    cost = {i: params[i].compute - params[i].wgrad + rings[params[i].ring] for i in skip}
    buckets = _buckets(params, skip, g.size)
    sizes = [sum(params[i].numel for i in b) for b in buckets]
    colls = [env.net.collective("reduce_scatter", n * ACC_BYTES, g) for n in sizes]
    sides = {0: Side(compute=lambda x: cost.get(x.block, params[x.block].compute if x.block < len(params) else 0.0),
                     name="backward"),
             B.COLL: Side(collective=lambda x: colls[x.block])}
    clock = walk_clock(env, [_steps(params, buckets)], prices(env, g, sides))
    compute_end = max((e for lane, _, e, _ in clock.events if lane == "compute"), default=0.0)
    return DpTimes(clock.t - compute_end, compute_end - sum(p.compute for p in params))
