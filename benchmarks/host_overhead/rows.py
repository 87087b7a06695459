"""Host overhead of every public operator on torch's fake process group: us per call and per ring step.

    rows(worlds=(2, 4, 8), calls=200, rounds=5) -> [{"op", "world", "algo", "fwd_us", "fwdbwd_us", "steps",
                                                     "step_us"}, ...]
    markdown(rows) -> the table of run.py's markdown

One process is rank 0 of a fake world of P ranks (`init_process_group("fake")`): every collective and P2P op
completes at once without moving data, so a call's time is the host's: Python, dispatch, the tiny GEMMs
(tensors of a few hundred elements), the executor walk. Each operator runs its flash algo and its reference
("reference": the stock collective, then the GEMM); all_reduce compares "ring" with "reference". A figure
is the median over rounds (runtime/timing.py `interleaved`, one warm-up round) of `calls` back-to-back calls.
steps = executor steps per call (forward + backward where it has one), counted from the context's trace in
a separate call; step_us = fwdbwd_us / steps (fwd_us / steps where the operator has no backward).
Peer checks are off (check_peers="never"): on the fake group the check's all-gather returns no data.
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

import megatron_flashoverlap.ops as ops
from megatron_flashoverlap.runtime import OverlapContext
from megatron_flashoverlap.runtime.timing import interleaved

B, H, HEADS, HN = 2, 16, 8, 4  # batch, hidden, attention heads (divisible by 8 for Ulysses), head dim
_PLANS = {a: ops.OpPlan(a) for a in ("flash", "reference")}  # made once, as a layer makes its plan
_HEADS = ops.Attend(heads=HEADS)


def _tensors(world: int) -> dict:
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=g)
    s = 2 * world  # two sequence rows per rank
    return {"x_s": r(2, B, H), "x": r(s, B, H), "w": r(H, H), "bias": r(H), "flat": r(s * H),
            "q": r(s, B, HEADS // world, HN), "kv": r(s, B, HEADS // world, HN), "wp": r(H, HEADS // world * HN),
            "q_s": r(2, B, HEADS, HN), "w_qkv": r(3 * HEADS * HN, H), "w_proj": r(H, HEADS * HN),
            "grad": r(world * H * H)}


def _calls(t: dict, ctx) -> dict:
    """op -> (fn(algo) -> output to backpropagate or None, ours, reference, differentiable inputs)."""
    kw, bucket = {"context": ctx}, ops.DPBucket(t["grad"], 0)  # the bucket, as a DP site holds it
    return {
        "all_gather_matmul": (lambda a: ops.all_gather_matmul(t["x_s"], t["w"], bias=t["bias"], algo=a, **kw),
                              "flash", "reference", ("x_s", "w")),
        "matmul_reduce_scatter": (lambda a: ops.matmul_reduce_scatter(t["x"], t["w"], algo=a, **kw),
                                  "flash", "reference", ("x", "w")),
        "matmul_all_reduce": (lambda a: ops.matmul_all_reduce(t["x"], t["w"], algo=a, **kw), "flash", "reference",
                              ("x", "w")),
        "matmul_allreduce_dgrad": (lambda a: ops.matmul_allreduce_dgrad(t["x"], t["w"], bias=t["bias"], algo=a, **kw),
                                   "flash", "reference", ("x", "w")),
        "all_reduce": (lambda a: ops.all_reduce(t["flat"], algo=a, **kw), "ring", "reference", ()),
        "query_split_attention": (lambda a: ops.query_split_attention(t["q"], t["kv"], t["kv"], t["wp"],
                                                                      plan=_PLANS[a], **kw),
                                  "flash", "reference", ("q", "kv", "wp")),
        "ulysses_attention": (lambda a: ops.ulysses_attention(t["q_s"], t["q_s"], t["q_s"], algo=a, **kw),
                              "flash", "reference", ("q_s",)),
        "ulysses_fused_attention": (lambda a: ops.ulysses_fused_attention(t["x_s"], t["w_qkv"], t["w_proj"],
                                                                          attend=_HEADS, algo=a, **kw),
                                    "flash", "reference", ("x_s", "w_qkv", "w_proj")),
        "matmul_wgrad_reduce_scatter": (lambda a: ops.matmul_wgrad_reduce_scatter(t["x"], t["x"], bucket, None,
                                                                                  algo=a, **kw),
                                        "flash", "reference", ()),
    }


def _one(fn, algo: str, t: dict, grads: tuple, backward: bool) -> None:
    for k in grads:
        t[k].requires_grad_(backward)
        t[k].grad = None
    y = fn(algo)
    if backward and grads:
        y.backward(torch.ones_like(y))


def _variant(fn, algo: str, t: dict, grads: tuple, backward: bool, calls: int):
    def run() -> float:
        t0 = time.perf_counter()
        for _ in range(calls):
            _one(fn, algo, t, grads, backward)
        return (time.perf_counter() - t0) / calls
    return run


def _steps(fn, algo: str, t: dict, grads: tuple, ctx) -> int:
    """Executor steps of one call (forward + backward): the trace records one "wait" per step."""
    ctx.trace = []
    _one(fn, algo, t, grads, bool(grads))
    n = sum(e.what == "wait" and e.label.startswith("step ") for e in ctx.trace)
    ctx.trace = None
    return n


def _world_rows(world: int, calls: int, rounds: int) -> list[dict]:
    t, ctx = _tensors(world), OverlapContext(check_peers=False)
    table = _calls(t, ctx)
    variants = {}
    for op, (fn, ours, ref, grads) in table.items():
        for algo in (ours, ref):
            variants[(op, algo, "fwd")] = _variant(fn, algo, t, grads, False, calls)
            if grads:
                variants[(op, algo, "fwd+bwd")] = _variant(fn, algo, t, grads, True, calls)
    med = {k: statistics.median(v) * 1e6 for k, v in interleaved(variants, rounds).items()}
    out = []
    for op, (fn, ours, ref, grads) in table.items():
        for algo in (ours, ref):
            steps = _steps(fn, algo, t, grads, ctx) if algo == ours else 0
            both = med.get((op, algo, "fwd+bwd"))
            out.append({"op": op, "world": world, "algo": algo, "fwd_us": med[(op, algo, "fwd")], "fwdbwd_us": both,
                        "steps": steps, "step_us": (both or med[(op, algo, "fwd")]) / steps if steps else None})
    return out


def _init(world: int) -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)


def rows(worlds=(2, 4, 8), calls: int = 200, rounds: int = 5) -> list[dict]:
    """The table's rows for every world size (this process becomes rank 0 of a fake world of each size)."""
    torch.set_num_threads(1)
    flush = torch.set_flush_denormal(True)  # buffers the fake group never fills may hold denormals: slow GEMMs
    out = []
    try:
        for world in worlds:
            _init(world)
            out += _world_rows(world, calls, rounds)
        dist.destroy_process_group()
    finally:
        if flush:
            torch.set_flush_denormal(False)
    return out


def _fmt(v) -> str:
    return "" if v is None else f"{v:.1f}"


def markdown(rs: list[dict]) -> str:
    head = ["| op | P | algo | us/call fwd | us/call fwd+bwd | steps | us/step |", "|---|---|---|---|---|---|---|"]
    return "\n".join(head + [f"| {r['op']} | {r['world']} | {r['algo']} | {_fmt(r['fwd_us'])} | "
                             f"{_fmt(r['fwdbwd_us'])} | {r['steps'] or ''} | {_fmt(r['step_us'])} |" for r in rs])
