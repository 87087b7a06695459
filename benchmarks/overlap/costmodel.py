"""Cost model: predict each method's block time from the measured link bandwidth and GEMM throughput.

Inputs (measured by the worker): B = bytes/s a rank receives while every rank sends (stock all-gather
probe; on a shaped lo both directions share one queue, so this already is the per-direction rate under
load) and F(rows) = GEMM flop/s at that row count (small slices run slower). Per operator of P ranks:

    hop  = L + bytes of one shard / B   (L: measured latency of one tiny all-gather)
    C    = whole GEMM time (sum of its slices, each at its row count's F)
    AG side (column fwd, row bwd): transfers run back to back from t=0; a slice starts when its data
        arrived and the previous slice ended.
        stock: one hop, then C.   slicing k: k chunks of hop/k, chunk j computes after arrival j.
        flash: slice 0 is the local shard (no wait), slice j after hop j.  (P=2: max(C/2, hop) + C/2)
    RS side (row fwd, column dgrad): a slice's transfer starts when the slice and the previous
        transfer ended.   stock: C, then one hop.   slicing k: k chunks.   flash: own block last.
A bidirectional ring at P=2 sends both halves to the same peer through the same shared lo queue: the
model gives it the same hop as `flash`. Backward: column dgrad RS + wgrad AG in one walk (flash: both
hops per step; slicing/stock: blocking re-gather of x for wgrad); row backward is one AG of dy.
The middle part (GELU / attention core) is measured alone; its backward is taken as 2x its forward.

Query-split attention (ops/attention/query_split.py; unitless, at the end of this file): `exposed_hops`
runs the Flash-RS ring with per-block compute costs, `causal_block_costs` gives those costs for causal
attention. For P = 4, causal blocks cost 1, 3, 5, 7 (unit = cost of block 0): a hop of 2 units leaves 1 unit
exposed, a hop of 4 units 4 units (uniform blocks of 4 hide both). Zigzag blocks (d, 2P-1-d) all cost the same.
"""
from __future__ import annotations

import bisect

from megatron_flashoverlap.ops.attention.core import zigzag_positions
from benchmarks.harness.blocks import Method, Shape


def gemm_time(rows: int, k: int, n: int, flops: dict) -> float:
    """Seconds for [rows, k] @ [k, n] at the throughput probed at the nearest row count (keys may be str)."""
    table = {int(r): v for r, v in flops.items()}
    keys = sorted(table)
    i = min(bisect.bisect_left(keys, rows), len(keys) - 1)
    if i > 0 and abs(keys[i - 1] - rows) < abs(keys[i] - rows):
        i -= 1
    return 2.0 * rows * k * n / table[keys[i]]


def ag_pipeline(slices: list[tuple[int | None, float]], hops: list[float]) -> float:
    """slices: (index of the transfer it needs or None, seconds); transfers back to back from 0."""
    arrive, t = [], 0.0
    for h in hops:
        t += h
        arrive.append(t)
    end = 0.0
    for need, c in slices:
        end = max(end, arrive[need] if need is not None else 0.0) + c
    return end


def rs_pipeline(slices: list[tuple[float, float]]) -> float:
    """slices: (compute seconds, seconds of the transfer it starts afterwards, 0 for none)."""
    comp = comm = 0.0
    for c, h in slices:
        comp += c
        if h > 0:
            comm = max(comm, comp) + h
    return max(comp, comm)


def _parts(method: Method, world: int) -> int:
    return method.chunks if method.algo == "slicing" else (1 if method.algo == "reference" else world)


def op_time(side: str, method: Method, gemm: tuple[int, int, int], shard_bytes: float, probes: dict,
            world: int, hop_factor: float = 1.0) -> float:
    """One AG-side or RS-side operator: gemm = (rows, k, n), [rows, k] @ [k, n] over the full GEMM rows,
    `shard_bytes` per hop of the stock collective."""
    rows, k, n = gemm
    lat = probes.get("latency_s", 0.0)
    hop = hop_factor * shard_bytes / probes["link_Bps"]
    flops = probes["gemm_flops"]
    p = _parts(method, world)
    c = gemm_time(max(1, rows // p), k, n, flops)  # one slice (flash: one shard's rows; slicing: one chunk)
    if method.algo == "reference":
        return ag_pipeline([(0, c)], [lat + hop]) if side == "ag" else rs_pipeline([(c, lat + hop)])
    if method.algo == "slicing":
        if side == "ag":
            return ag_pipeline([(j, c) for j in range(p)], [lat + hop / p] * p)
        return rs_pipeline([(c, lat + hop / p)] * p)
    if side == "ag":  # flash: local shard first, then one slice per arrived hop
        return ag_pipeline([(None, c)] + [(j, c) for j in range(world - 1)], [lat + hop] * (world - 1))
    return rs_pipeline([(c, lat + hop)] * (world - 1) + [(c, 0.0)])  # own block last


def predict(kind: str, shape: Shape, method: Method, probes: dict, world: int, mode: str) -> float:
    """Predicted seconds of one block (forward, or forward+backward)."""
    s, b, h, w = shape.seq, shape.batch, shape.hidden, shape.width
    n_in = 3 * w if kind == "attn" else w
    shard = s // world * b * h * 4.0  # fp32 bytes of one [s/P, b, h] shard
    mid = probes["middle_s"].get(f"{kind}|{s}", 0.0)
    rows = s * b
    t = op_time("ag", method, (rows, h, n_in), shard, probes, world) + mid + \
        op_time("rs", method, (rows, w, h), shard, probes, world)
    if mode == "fwd":
        return t
    # backward: row (AG of dy; dgrad + wgrad per slice), middle, column (dgrad RS + wgrad on gathered x)
    t += op_time("ag", method, (rows, w, 2 * h), shard, probes, world) + 2 * mid
    if method.algo == "slicing" or method.algo == "reference":  # RS of dgrad, then a blocking gather of x
        t += op_time("rs", method, (rows, n_in, h), shard, probes, world) \
            + shard / probes["link_Bps"] + probes.get("latency_s", 0.0) \
            + gemm_time(rows, n_in, h, probes["gemm_flops"])
    else:  # one walk: dgrad RS + wgrad AG hops together, dgrad + wgrad slice per step
        t += op_time("rs", method, (rows, n_in, 2 * h), shard, probes, world, hop_factor=2.0)
    return t


def choose_site(site: str, side: str, gemm: tuple[int, int, int], shard_bytes: float, probes: dict,
                world: int, methods) -> tuple[str, str]:
    """(choice, one-line reason) among flash / slicing k / reference for one GEMM site (gemm: (rows, k, n))."""
    rows, k, n = gemm
    times = {m.name: op_time(side, m, gemm, shard_bytes, probes, world) for m in methods}
    best = min(times, key=times.get)
    hop = shard_bytes / probes["link_Bps"]
    whole = gemm_time(rows, k, n, probes["gemm_flops"])
    algo = {"stock": "reference"}.get(best, best)
    others = ", ".join(f"{m} {t * 1e3:.1f}" for m, t in sorted(times.items(), key=lambda kv: kv[1])[1:4])
    reason = (f"{site}: {algo} ({times[best] * 1e3:.1f} ms predicted; next: {others} ms); "
              f"hop {hop * 1e3:.1f} ms vs GEMM {whole * 1e3:.1f} ms, comm/compute {hop / whole:.2f}")
    return algo, reason


def sites(shape: Shape, probes: dict, world: int, methods) -> list[tuple[str, str]]:
    """Choices for the forward GEMM sites of the MLP and attention blocks."""
    s, b, h, w = shape.seq, shape.batch, shape.hidden, shape.width
    shard = s // world * b * h * 4.0
    rows = s * b
    spec = [("fc1_fprop", "ag", h, w), ("fc2_fprop", "rs", w, h), ("qkv_fprop", "ag", h, 3 * w),
            ("proj_fprop", "rs", w, h)]
    return [choose_site(name, side, (rows, k, n), shard, probes, world, methods) for name, side, k, n in spec]


def calibrate(probes: dict, kind: str, shape: Shape, world: int, compute_s: float, comm_s: float) -> dict:
    """Probes rescaled so the model reproduces the stock method's measured forward compute alone and comm
    alone of this point (interleaved with the other methods, so the load they saw is the same): the GEMM
    flop/s keep their probed shape over row counts, the link keeps its latency. Other methods are then
    predicted from these two primitives."""
    stock = Method("stock", "reference")
    no_link = {**probes, "link_Bps": float("inf"), "latency_s": 0.0}
    mid = probes["middle_s"].get(f"{kind}|{shape.seq}", 0.0)
    pred_gemm = predict(kind, shape, stock, no_link, world, "fwd") - mid
    scale = pred_gemm / max(compute_s - mid, 1e-9)
    hops = 2  # stock forward: one all-gather + one reduce-scatter of one shard each
    shard = shape.seq // world * shape.batch * shape.hidden * 4.0
    per_hop = max(comm_s / hops - probes.get("latency_s", 0.0), 1e-9)
    return {**probes, "gemm_flops": {k: v * scale for k, v in probes["gemm_flops"].items()},
            "link_Bps": shard / per_hop}


# ------------------------------------------------------------------ query-split attention (causal blocks)

def exposed_hops(block_costs: list[float], hop: float, world: int) -> float:
    """Cost model of the Flash-RS ring with per-block compute costs: time past the pure compute.

    done_i(r) = max(done_{i-1}(r) + cost[r-1-i], done_{i-1}(r-1) + hop)  (the partial arrives one hop after
    the previous rank finished the step before). Returns max_r done_{P-1}(r) - sum(costs)."""
    done = [block_costs[(r - 1) % world] for r in range(world)]
    for i in range(1, world):
        done = [max(done[r] + block_costs[(r - 1 - i) % world], done[(r - 1) % world] + hop) for r in range(world)]
    return max(done) - sum(block_costs)


def causal_block_costs(seq: int, world: int, zigzag: bool = False) -> list[float]:
    """Causal attention work of each RS block (query row at position t sees t+1 keys), in key-row units.

    plain: block d = rows [d s/P, (d+1) s/P): cost grows with d (block 0 ~ 1/(2P-1) of block P-1);
    zigzag: block d = chunks (d, 2P-1-d) of 2P: every block costs the same (s^2/(2P) + s/2)."""
    pos = zigzag_positions(seq, world).tolist() if zigzag else list(range(seq))
    n = seq // world
    return [float(sum(t + 1 for t in pos[d * n:(d + 1) * n])) for d in range(world)]
