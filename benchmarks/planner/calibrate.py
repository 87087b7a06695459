"""What the planner is calibrated with on the CPU proxy, measured on every rank at once (one gloo process per
rank, one thread each, as every benchmark runs them). Every figure is a median over rounds of the one timing loop
(megatron_flashoverlap/runtime/timing.py: variants interleaved, one warm-up round, max over ranks), with its
spread (min, max over rounds).

    gemm        {"m,k,n": s}      y[m, n] = x[m, k] @ w[k, n] in fp32, every rank computing at once
    gelu        {"rows,width": s} F.gelu forward, and forward + backward ("bwd" key)
    add         {"elements": s}   one in-place add (an arrived partial into its sum), fp32 (or the dtype asked)
    hop         {"bytes": s}      one walk of our Flash-AG ring (runtime.gather_and_consume, nothing consumed):
                                  P-1 hops of `bytes` each through the executor, every rank sending at once
    allgather   {"bytes": s}      stock's gloo all-gather of `bytes` per rank (runtime.all_gather_into)
    allreduce   {"bytes": s}      gloo's own all-reduce of `bytes` per rank
    slowdown    a GEMM alone, and the same GEMM while a gloo all-gather of `slow_bytes` runs beside it
"""
from __future__ import annotations

import statistics

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_flashoverlap.runtime import OverlapContext, all_gather_into, gather_and_consume
from megatron_flashoverlap.runtime.timing import interleaved, rank_max, timed


def _stats(samples: dict) -> dict:
    return {str(k): {"median": statistics.median(v), "lo": min(v), "hi": max(v), "n": len(v)}
            for k, v in samples.items()}


def figures_of(variants: dict, rounds: int) -> dict:
    return _stats(rank_max(interleaved(variants, rounds, rotate=True)))


def gemm_variants(shapes) -> dict:
    out = {}
    for m, k, n in shapes:
        x, w = torch.randn(m, k), torch.randn(k, n)
        out[f"{m},{k},{n}"] = (lambda x=x, w=w: timed(lambda: torch.matmul(x, w)))
    return out


def gelu_variants(shapes) -> dict:
    out = {}
    for rows, width in shapes:
        x = torch.randn(rows, width)
        out[f"{rows},{width}"] = (lambda x=x: timed(lambda: F.gelu(x)))

        def fwd_bwd(x=x):
            xr = x.detach().requires_grad_()
            y = F.gelu(xr)
            return timed(lambda: y.backward(y.detach()))
        out[f"{rows},{width},bwd"] = fwd_bwd
    return out


def add_variants(sizes, dtype=torch.float32) -> dict:
    out = {}
    for n in sizes:
        a, b = torch.randn(n).to(dtype), torch.randn(n).to(dtype)
        out[str(n)] = (lambda a=a, b=b: timed(lambda: a.add_(b)))
    return out


def link_variants(sizes, world: int, ctx: OverlapContext) -> dict:
    out = {}
    for nbytes in sizes:
        x = torch.ones(max(1, nbytes // 4))
        gathered = torch.empty(world * x.numel())
        out[f"hop:{nbytes}"] = (lambda x=x: timed(lambda: gather_and_consume(x, lambda rows, t: None, None, ctx)))
        out[f"allgather:{nbytes}"] = (lambda x=x, g=gathered: timed(lambda: all_gather_into(g, x, None)))
        out[f"allreduce:{nbytes}"] = (lambda x=x: timed(lambda: dist.all_reduce(x.clone())))
    return out


def slowdown_variants(shape, nbytes: int, world: int) -> dict:
    m, k, n = shape
    a, b = torch.randn(m, k), torch.randn(k, n)
    x = torch.ones(nbytes // 4)
    gathered = torch.empty(world * x.numel())

    def beside():
        work = dist.all_gather_into_tensor(gathered, x, async_op=True)
        t = timed(lambda: torch.matmul(a, b), barrier=False)
        work.wait()
        return t
    return {"alone": lambda: timed(lambda: torch.matmul(a, b)), "beside": beside}


def main(rank: int, world: int, cfg: dict) -> dict:
    """{section: {key: {median, lo, hi, n}}} for the sections cfg asks (module docstring)."""
    torch.set_num_threads(1)
    torch.manual_seed(rank)
    rounds, out = cfg.get("rounds", 3), {"world": world}
    with torch.no_grad():
        if cfg.get("gemm"):
            out["gemm"] = figures_of(gemm_variants(cfg["gemm"]), rounds)
        if cfg.get("add"):
            out["add"] = figures_of(add_variants(cfg["add"]), rounds)
    if cfg.get("gelu"):
        out["gelu"] = figures_of(gelu_variants(cfg["gelu"]), rounds)
    if cfg.get("link"):
        ctx = OverlapContext(check_peers=False)
        out["link"] = figures_of(link_variants(cfg["link"], world, ctx), rounds)
    if cfg.get("slowdown"):
        with torch.no_grad():
            out["slowdown"] = figures_of(slowdown_variants(*cfg["slowdown"], world), rounds)
    return out
