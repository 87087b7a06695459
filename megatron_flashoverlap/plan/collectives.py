"""The other operators: TP without SP (all-reduce), the decode all-reduce, Ulysses all-to-all, MoE, DP wgrad ring.

    ar_fwd(M, K, N)    y [M, N] = AR(x_r [M, K/P] @ W_r [K/P, N])  (row-parallel, TP without SP)
        flash:C  ops/tp_nosp/plain.py: C sequence chunks; walk c merges chunk c's Flash-RS (tag 0) with chunk
                 c-1's Flash-AG (tag 1); the last AG walks alone (its hops are the exposed tail)
    ar_bwd(M, K, N)    dx [M, K] = AR(dy_r [M, N/P] @ W_r^T), dW_r = x^T dy_r  (column-parallel, TP without SP)
        stock: the dgrad GEMM, then its all-reduce under the wgrad GEMM (Megatron's allreduce_dgrad); flash: the
        same chunk walks with the wgrad in P-1 pieces under the last AG (schedules.ring_tail, tag 2)
    all_reduce(bytes)  reference: NCCL's choice; flash:<algo>: schedules.all_reduce_schedule, walked per rank
    ulysses(tensors)   the a2a of Ulysses attention: stock all_to_all_single per tensor; flash: one merged walk
                       of schedules.all_to_all_produce, one tag per tensor (ops/attention/ulysses.py)
    moe(...)           dispatch, the local experts, combine: stock a2a, experts, a2a; flash: schedules.expert_pipeline
    dp_ring(...)       ops/dp/wgrad_rs.py's ring alone: the weight gradient reduce-scattered shard by shard over the
                       DP group (fp32 gradients on the wire), own shard last
"""
from __future__ import annotations

import math

import megatron_flashoverlap.schedules as S  # module attributes: a changed schedule changes the price
from ..schedules import Slice, Step
from . import baselines as B
from .links import Group
from .ops import OpTimes, chunked_walk, evaluate
from .price import ACC_BYTES, Env, Side, collective_side, collectives_side, prices
from .walk import Prices, run

AR_CHUNKS = (1, 2, 4)  # all_reduce.num_chunks of ops/tp_nosp (DEFAULT_CHUNKS = 2)


def _ar_chunk_walks(env: Env, g: Group, m: float, n: float, produce, tail=None) -> tuple[list, Prices]:
    """The C = len(chunks) walks of ar_matmul_ring; produce(rows) prices the RS slice; tail: (pieces, seconds)."""
    lists, sides = [], {}
    chunks = produce[1]
    for c in range(chunks + 1):
        parts = []
        if c < chunks:
            parts.append(S.reduce_scatter_ring(0, g.size, tag=0))
        if c > 0:
            parts.append(S.all_gather_ring(0, g.size, tag=1))
        if c == chunks and tail is not None:
            parts.append(S.ring_tail(0, g.size, pieces=tail[0], tag=2))
        lists.append(S.merge(*parts) if len(parts) > 1 else parts[0].steps)
    rows = m / (chunks * g.size)
    b = env.bytes
    sides[0] = Side(compute=lambda x: produce[0](rows), nbytes=lambda x: rows * n * b, arrival=env.add(rows * n),
                    name="GEMM")
    sides[1] = Side(compute=lambda x: env.gemm.elementwise(rows * n * b, 2.0), nbytes=lambda x: rows * n * b,
                    name="copy")
    if tail is not None:
        sides[2] = Side(compute=lambda x: tail[1], name="wgrad")
    return lists, prices(env, g, sides)


def ar_fwd(env: Env, g: Group, m: int, k: int, n: int) -> OpTimes:
    p, b = g.size, env.bytes
    whole = env.mm(m, k / p, n)
    coll = env.net.collective("all_reduce", m * n * b, g)
    variants = {"reference": chunked_walk(env, g, B.produce_chunks(1), lambda j: whole,
                                          collective_side(env, g, "all_reduce", m * n * b))}
    for c in (2, 4, 8):
        variants[f"slicing:{c}"] = chunked_walk(env, g, B.produce_chunks(c), lambda j, c=c: env.mm(m / c, k / p, n),
                                                collective_side(env, g, "all_reduce", m * n * b / c))
    if p > 1:
        for c in AR_CHUNKS:
            variants[f"flash:{c}"] = _ar_chunk_walks(env, g, m, n, (lambda r: env.mm(r, k / p, n), c))
    hops = 2 * (p - 1) * env.net.hop(m / p * n * b, m / p * n * b, g.spans, env.net.ring_senders(g))
    return evaluate("matmul_all_reduce", env, variants, (whole, coll, hops, max(whole, hops + whole / p)))


def ar_bwd(env: Env, g: Group, m: int, k: int, n: int) -> OpTimes:
    p, b = g.size, env.bytes
    dgrad, wgrad = env.mm(m, n / p, k), env.mm(k, m, n / p)
    coll = env.net.collective("all_reduce", m * k * b, g)
    stock = (Step(compute=(Slice(0, 0, 0),)), Step(sends=B.produce_chunks(1)[1].sends, compute=(Slice(0, 0, 1),)))
    wg = {1: Side(compute=lambda x: wgrad, name="wgrad")}
    variants = {"reference": chunked_walk(env, g, stock, lambda j: dgrad,
                                          collective_side(env, g, "all_reduce", m * k * b), wg)}
    for c in (2, 4, 8):
        steps = list(B.produce_chunks(c))
        steps[-1] = Step(sends=steps[-1].sends, compute=(Slice(0, 0, 1),))
        variants[f"slicing:{c}"] = chunked_walk(env, g, tuple(steps), lambda j, c=c: env.mm(m / c, n / p, k),
                                                collective_side(env, g, "all_reduce", m * k * b / c), wg)
    if p > 1:
        piece = env.mm(k, m / (p - 1), n / p)
        for c in AR_CHUNKS:
            variants[f"flash:{c}"] = _ar_chunk_walks(env, g, m, k, (lambda r: env.mm(r, n / p, k), c), (p - 1, piece))
    hops = 2 * (p - 1) * env.net.hop(m / p * k * b, m / p * k * b, g.spans, env.net.ring_senders(g))
    whole = dgrad + wgrad
    return evaluate("matmul_allreduce_dgrad.backward", env, variants, (whole, coll, hops, max(whole, hops + dgrad / p)))


def _exchange_prices(env: Env, g: Group, r: int, block: float, pair: bool) -> Prices:
    senders = env.net.pair_senders(g) if pair else env.net.ring_senders(g)

    def crosses(sends, recvs) -> bool:
        """A peer of the unit sits on another node than rank r."""
        return any(g.node_of(t.peer) != g.node_of(r) for t in tuple(sends) + tuple(recvs))

    def transfer(sends, recvs) -> float:
        return env.net.hop(block * len(sends), block * len(recvs), crosses(sends, recvs), senders)

    return Prices(compute=lambda x: 0.0, transfer=transfer, fixed=lambda s, rv: env.net.hop_fixed(crosses(s, rv)),
                  arrived=lambda t: env.gemm.elementwise(block, 2.0 if t.op == "copy" else 3.0))


def _all_reduce_algo(env: Env, g: Group, nbytes: float, algo: str) -> float:
    p = g.size
    hier = S.ALL_REDUCE[algo].two_level  # the node layout matters
    local = g.per_node if hier else None
    ranks = [0] if algo == "ring" else (range(0, p, g.per_node) if hier else range(p))
    worst = 0.0
    for r in ranks:
        sched = S.all_reduce_schedule(algo, r, p, local)
        block = nbytes / len(sched.final)
        worst = max(worst, run(sched.steps, _exchange_prices(env, g, r, block, algo != "ring"), 0.0).t)
    return worst


def all_reduce(env: Env, g: Group, nbytes: float) -> OpTimes:
    """One all-reduce of `nbytes` per rank: reference = NCCL's choice, flash:<algo> = our schedules."""
    c = env.cluster
    ref = env.net.collective("all_reduce", nbytes, g)
    times = {"reference": ref}
    if g.size > 1:
        times.update({f"flash:{a}": _all_reduce_algo(env, g, nbytes, a) for a in S.ALL_REDUCE_SCHEDULES})
    nodes, per = g.nodes, g.per_node
    bw = 2 * (per - 1) / per * nbytes / (c.intra.gbps * 1e9)
    if nodes > 1:
        bw += 2 * (nodes - 1) / nodes * nbytes / per / (c.inter.gbps * 1e9 * min(1.0, c.nics_per_node / per))
    lat = math.ceil(math.log2(g.size)) * min(c.intra.hop_lat_us) * 1e-6 if g.size > 1 else 0.0
    return OpTimes("all_reduce", 0.0, ref, min(times.values()), times, max(bw, lat))


def ulysses(env: Env, g: Group, tensor_bytes: list[float], name: str = "ulysses_a2a") -> OpTimes:
    """The a2a of `tensor_bytes` (each rank's whole buffer per tensor) over the CP group."""
    p = g.size
    colls = [env.net.collective("all_to_all", t, g) for t in tensor_bytes]
    lists = [(Step(sends=tuple(B._coll(i, B.COLL, lag=0) for i in range(len(colls)))),)]
    ref = (lists, prices(env, g, {B.COLL: collectives_side(env, g, [("all_to_all", t) for t in tensor_bytes])}))
    variants = {"reference": ref}
    if p > 1:
        steps = S.merge(*(S.all_to_all_produce(0, p, tag=i) for i in range(len(tensor_bytes))))
        sides = {i: Side(compute=lambda x, t=t: env.gemm.elementwise(t / p, 2.0), nbytes=lambda x, t=t: t / p,
                         name=f"piece{i}") for i, t in enumerate(tensor_bytes)}
        variants["flash:1"] = ([steps], prices(env, g, sides, pairwise=True))
    hops = sum(t / p for t in tensor_bytes) * (p - 1) / (env.cluster.link(g.spans).gbps * 1e9)
    return evaluate(name, env, variants, (0.0, sum(colls), hops, hops))


def moe(env: Env, g: Group, tokens: float, dims: tuple[int, int, int], experts: tuple[int, int],
        backward: bool = False) -> OpTimes:
    """dims (h, ffn per expert, 2 if SwiGLU else 1); experts (local experts, top-k). Uniform routing."""
    h, ffn, glu = dims
    local, topk = experts
    p, b, scale = g.size, env.bytes, 2.0 if backward else 1.0
    rows = tokens * topk / p  # one source block

    def experts_on(r: float) -> float:
        return scale * local * (env.mm(r / local, h, ffn * glu) + env.mm(r / local, ffn, h))

    a2a = env.net.collective("all_to_all", tokens * topk * h * b, g)
    stock = (Step(sends=(B._coll(0, B.COLL),)), Step(compute=(Slice(0, 0, 0),)), Step(sends=(B._coll(1, B.COLL),)))
    variants = {"reference": chunked_walk(env, g, stock, lambda j: experts_on(rows * p),
                                          collective_side(env, g, "all_to_all", tokens * topk * h * b))}
    if p > 1:
        sides = {0: Side(nbytes=lambda x: rows * h * b), 1: Side(nbytes=lambda x: rows * ACC_BYTES),
                 2: Side(compute=lambda x: experts_on(rows / 2 if x.block == 0 else rows),  # own block: half A
                         nbytes=lambda x: rows * h * b, name="experts"),
                 3: Side(compute=lambda x: experts_on(rows / 2), name="experts")}
        variants["flash:1"] = ([S.expert_pipeline(0, p).steps], prices(env, g, sides, pairwise=True))
    whole = experts_on(rows * p)
    hops = 2 * (p - 1) * env.net.hop(rows * h * b, rows * h * b, g.spans, env.net.pair_senders(g))
    return evaluate("moe_backward" if backward else "moe", env, variants, (whole, 2 * a2a, hops,
                                                                           max(whole, hops + whole / p)))


def dp_ring(env: Env, g: Group, rows_out: float, k_in: float) -> float:
    """Seconds of the DP ring alone over one weight gradient [rows_out, k_in] (module docstring): D - 1 hops of
    one fp32 shard each; its wgrad GEMM slices run beside it (plan/dp.py times them with the backward)."""
    d = g.size
    if d == 1:
        return 0.0
    shard = rows_out * k_in / d
    return (d - 1) * env.net.hop(shard * ACC_BYTES, shard * ACC_BYTES, g.spans, env.net.ring_senders(g))
