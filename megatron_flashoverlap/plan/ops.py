"""Per operator: the time of every algorithm, from walks of its step lists.

Shapes are the unsharded GEMM y[M, N] = x[M, K] W[K, N] on a group of P ranks, sharded as Megatron does:
    column (all-gather + GEMM):  x's rows over P (sequence parallel), W's columns over P    y_r [M, N/P]
    row (GEMM + reduce-scatter): K over P, the output's rows scattered                      y_r [M/P, N]
    forward    column: AG(x) @ W_r            row: RS(x_r @ W_r)
    backward   column: dgrad RS(dy_r W_r^T) + wgrad AG(x)^T dy_r (one merged ring walk: dgrad RS tag 0, wgrad
               AG tag 1, ops/tp_sp/plain.py); stock overlaps AG(x) with dgrad and RS(dx) with wgrad (bulk)
               row: AG(dy) then dgrad AG(dy) W_r^T and wgrad x_r^T AG(dy), per arrived dy shard (flash)
Variants: "reference" (blocking collective, GEMM; the backward as stock Megatron runs it), "slicing:k" (the data-
slicing baseline of ops/, k chunks), "flash:c" (schedules.all_gather_ring / reduce_scatter_ring, c hop sub-
chunks), "flash_bidir" (the bidirectional ring). An algorithm's time is that of its best variant.

    compute  the operator's GEMMs, whole, alone          comm  stock's collective(s) alone
    ring     our ring's hops alone                       bound max(compute, ring + one slice): where the link
             is the longer, the first (RS) or last (AG) slice cannot overlap it
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import megatron_flashoverlap.schedules as S  # module attributes: a changed schedule changes the price
from ..schedules import Step
from . import baselines as B
from .links import Group
from .price import ACC_BYTES, Env, Side, collective_side, collectives_side, prices, walk_clock
from .walk import Clock

SLICING_CHUNKS = (2, 4, 8)  # configs: num_chunks of the slicing baseline
HOP_CHUNKS = (1, 2, 4)  # ops/tp_sp/plain.py hop_chunks_for: sub-chunks per hop
ALGO_ORDER = ("reference", "flash", "flash_bidir", "slicing")  # ties go to the earlier (the simpler)


@dataclass(frozen=True)
class OpTimes:
    """Seconds of one operator per variant (module docstring)."""

    name: str
    compute: float
    comm: float
    ring: float
    times: Mapping[str, float]
    bound: float
    replay: Mapping[str, Callable[[], Clock]] = field(default_factory=dict, compare=False, repr=False)

    def best(self, algo: str) -> tuple[str, float]:
        """(variant, seconds) of algo's fastest variant."""
        mine = {v: t for v, t in self.times.items() if v.split(":")[0] == algo}
        v = min(mine, key=mine.get)
        return v, mine[v]

    def time(self, algo: str) -> float:
        return self.best(algo)[1]

    def algos(self) -> tuple[str, ...]:
        return tuple(a for a in ALGO_ORDER if any(v.split(":")[0] == a for v in self.times))

    def choice(self) -> str:
        """The fastest algorithm (ties: ALGO_ORDER)."""
        return min(self.algos(), key=lambda a: (round(self.time(a), 12), ALGO_ORDER.index(a)))


def combine(name: str, parts: Sequence[OpTimes]) -> OpTimes:
    """One operator made of several run in sequence (e.g. forward + backward): variants with one key add up."""
    keys = set.intersection(*(set(p.times) for p in parts))
    return OpTimes(name, sum(p.compute for p in parts), sum(p.comm for p in parts), sum(p.ring for p in parts),
                   {k: sum(p.times[k] for p in parts) for k in keys}, sum(p.bound for p in parts),
                   {k: _chain([p.replay[k] for p in parts if k in p.replay]) for k in keys})


def _chain(replays):
    def replay() -> Clock:
        out, shift = Clock(), 0.0
        for r in replays:
            c = r()
            out.events += [(lane, a + shift, b + shift, txt) for lane, a, b, txt in c.events]
            shift += c.t
        out.t = shift
        return out
    return replay


@dataclass(frozen=True)
class RingSide:
    """One ring of an operator: `kind` "ag" (consume) or "rs" (produce), over `rows` gathered/pre-scatter rows;
    compute(rows), nbytes(rows) and arrival(rows) of a slice of `rows` rows."""

    kind: str
    rows: float
    compute: Callable[[float], float]
    nbytes: Callable[[float], float]
    arrival: Callable[[float], float] = lambda r: 0.0
    name: str = ""


def _schedule(kind: str, p: int, chunks: int, bidir: bool, tag: int) -> S.Schedule:
    build = S.all_gather_ring if kind == "ag" else S.reduce_scatter_ring
    return build(0, p, bidirectional=True, tag=tag) if bidir else build(0, p, chunks=chunks, tag=tag)


def flash_walk(env: Env, g: Group, rings: Sequence[RingSide], chunks: int = 1, bidir: bool = False):
    """(step lists, prices) of the merged ring walk of `rings` (tags 0, 1, ...)."""
    scheds = [_schedule(r.kind, g.size, chunks, bidir, tag) for tag, r in enumerate(rings)]
    steps = S.merge(*scheds) if len(scheds) > 1 else scheds[0].steps
    sides = {}
    for tag, r in enumerate(rings):
        rows = r.rows / (g.size * scheds[tag].parts)
        c, b, a = r.compute(rows), r.nbytes(rows), r.arrival(rows)
        sides[tag] = Side(compute=lambda x, c=c: c, nbytes=lambda x, b=b: b, arrival=a, name=r.name)
    return [steps], prices(env, g, sides)


def chunked_walk(env: Env, g: Group, steps: tuple[Step, ...], chunk: Callable[[int], float], coll: Side,
                 extra: Mapping[int, Side] | None = None):
    """(step lists, prices) of a baseline step list: compute slices of tag 0 cost chunk(block), its collective
    units priced by `coll` (price.collective_side); `extra` prices other tags."""
    sides = {0: Side(compute=lambda x: chunk(x.block), name="GEMM"), B.COLL: coll, **(extra or {})}
    return [steps], prices(env, g, sides)


def evaluate(name: str, env: Env, variants: Mapping[str, tuple], basics: tuple[float, float, float, float]) -> OpTimes:
    """OpTimes from {variant: (step lists, prices)} and (compute, comm, ring, bound)."""
    times, replay = {}, {}
    for v, (lists, pr) in variants.items():
        times[v] = walk_clock(env, lists, pr).t
        replay[v] = (lambda lists=lists, pr=pr: walk_clock(env, lists, pr))
    return OpTimes(name, *basics[:3], times, basics[3], replay)


def _ring_hops(env: Env, g: Group, nbytes_per_hop: float, rings: int = 1) -> float:
    return (g.size - 1) * env.net.hop(rings * nbytes_per_hop, rings * nbytes_per_hop, g.spans,
                                      env.net.ring_senders(g))


def _flash_variants(env: Env, g: Group, rings: Sequence[RingSide]) -> dict:
    out = {f"flash:{c}": flash_walk(env, g, rings, chunks=c) for c in HOP_CHUNKS if c == 1 or g.size > 1}
    if g.size > 1:
        out["flash_bidir"] = flash_walk(env, g, rings, bidir=True)
    return out


def _one_ring(env: Env, g: Group, name: str, ring: RingSide, stock: tuple) -> OpTimes:
    """A forward operator with one collective: `ring` (its slices and hops), stock = (NCCL collective, its whole
    buffer in bytes, the baseline's step-list builder: steps.consume_chunks or steps.produce_chunks)."""
    p, (kind, total, chunks) = g.size, stock
    whole = ring.compute(ring.rows)
    coll = env.net.collective(kind, total, g)
    variants = {"reference": chunked_walk(env, g, chunks(1), lambda j: whole, collective_side(env, g, kind, total))}
    for c in SLICING_CHUNKS:
        variants[f"slicing:{c}"] = chunked_walk(env, g, chunks(c), lambda j, c=c: ring.compute(ring.rows / c),
                                                collective_side(env, g, kind, total / c))
    variants.update(_flash_variants(env, g, [ring]))
    hops = _ring_hops(env, g, ring.nbytes(ring.rows / p))
    return evaluate(name, env, variants, (whole, coll, hops, max(whole, hops + whole / p)))


def column_fwd(env: Env, g: Group, m: int, k: int, n: int) -> OpTimes:
    """y [M, N/P] = AG(x [M/P, K]) @ W_r [K, N/P] (module docstring)."""
    p, b = g.size, env.gather_bytes  # the gathered x: FP8 bytes under fp8
    ring = RingSide("ag", m, lambda r: env.mm(r, k, n / p), lambda r: r * k * b, name="GEMM")
    return _one_ring(env, g, "all_gather_matmul", ring, ("all_gather", m * k * b, B.consume_chunks))


def row_fwd(env: Env, g: Group, m: int, k: int, n: int) -> OpTimes:
    """y_r [M/P, N] = RS(x_r [M, K/P] @ W_r [K/P, N]); partial sums in fp32, sent in the input dtype."""
    p, b = g.size, env.bytes
    ring = RingSide("rs", m, lambda r: env.mm(r, k / p, n), lambda r: r * n * b, lambda r: env.add(r * n), "GEMM")
    return _one_ring(env, g, "matmul_reduce_scatter", ring, ("reduce_scatter", m * n * b, B.produce_chunks))


def column_bwd(env: Env, g: Group, m: int, k: int, n: int) -> OpTimes:
    """dx [M/P, K] = RS(dy_r [M, N/P] @ W_r^T), dW_r [K, N/P] = AG(x)^T dy_r (module docstring)."""
    p, b, gb = g.size, env.bytes, env.gather_bytes  # dx's partials in the activation dtype, x re-gathered
    dgrad, wgrad = env.mm(m, n / p, k), env.mm(k, m, n / p)
    ag, rs = env.net.collective("all_gather", m * k * gb, g), env.net.collective("reduce_scatter", m * k * b, g)
    stock = B.bulk(S.Slice(0, 0, 0), S.Slice(1, 0, 0))
    variants = {"reference": chunked_walk(env, g, stock, lambda j: (dgrad, wgrad)[j], collectives_side(
        env, g, [("all_gather", m * k * gb), ("reduce_scatter", m * k * b)]))}
    for c in SLICING_CHUNKS:  # slicing RS of the dgrad, then a blocking re-gather of x and the whole wgrad
        steps = B.produce_chunks(c) + B.consume_chunks(1, compute_tag=1, coll_tag=B.COLL + 1)
        variants[f"slicing:{c}"] = chunked_walk(
            env, g, steps, lambda j, c=c: env.mm(m / c, n / p, k),
            collective_side(env, g, "reduce_scatter", m * k * b / c),
            {1: Side(compute=lambda x: wgrad, name="wgrad"),
             B.COLL + 1: collective_side(env, g, "all_gather", m * k * gb)})
    rings = [RingSide("rs", m, lambda r: env.mm(r, n / p, k), lambda r: r * k * b, lambda r: env.add(r * k),
                      "dgrad"),
             RingSide("ag", m, lambda r: env.mm(k, r, n / p), lambda r: r * k * gb, name="wgrad")]
    variants.update(_flash_variants(env, g, rings))
    hops = _ring_hops(env, g, m / p * k * (b + gb) / 2, rings=2)
    whole = dgrad + wgrad
    return evaluate("all_gather_matmul.backward", env, variants,
                    (whole, ag + rs, hops, max(whole, hops + whole / p)))


def row_bwd(env: Env, g: Group, m: int, k: int, n: int) -> OpTimes:
    """dx_r [M, K/P] = AG(dy [M/P, N]) W_r^T, dW_r [K/P, N] = x_r^T AG(dy) (module docstring)."""
    p, b = g.size, env.gather_bytes  # the gathered dy: FP8 bytes under fp8
    whole = env.mm(m, n, k / p) + env.mm(k / p, m, n)
    coll = env.net.collective("all_gather", m * n * b, g)
    variants = {"reference": chunked_walk(env, g, B.consume_chunks(1), lambda j: whole,
                                          collective_side(env, g, "all_gather", m * n * b))}
    for c in SLICING_CHUNKS:  # sliced gather of dy with the dgrad chunks, AG(dy) kept, then the whole wgrad
        steps = B.consume_chunks(c) + (Step(compute=(S.Slice(0, 0, 1),)),)
        variants[f"slicing:{c}"] = chunked_walk(
            env, g, steps, lambda j, c=c: env.mm(m / c, n, k / p), collective_side(env, g, "all_gather", m * n * b / c),
            {1: Side(compute=lambda x: env.mm(k / p, m, n), name="wgrad")})
    ring = RingSide("ag", m, lambda r: env.mm(r, n, k / p) + env.mm(k / p, r, n), lambda r: r * n * b,
                    name="dgrad+wgrad")
    variants.update(_flash_variants(env, g, [ring]))
    hops = _ring_hops(env, g, m / p * n * b)
    return evaluate("matmul_reduce_scatter.backward", env, variants, (whole, coll, hops, max(whole, hops + whole / p)))


__all__ = ["ACC_BYTES", "OpTimes", "RingSide", "chunked_walk", "column_bwd", "column_fwd", "combine", "evaluate",
           "flash_walk", "row_bwd", "row_fwd"]
