"""Rank side of benchmarks/dp/run.py: the DP reduce-scatter inside the wgrad GEMM, TP without SP, Megatron DDP.

    run_ranks("benchmarks.dp.ops_rows:main", 2, args=(cfg,))[0] -> {"config", "world", "rows"}

Rows (every sample: max over ranks after a barrier; medians over cfg["repeats"], min-max in "spread"):
- "dp wgrad+RS": the last bucket of a backward, wgrad [n, k] over `dp_tokens` rows. stock = Megatron's order
  (wgrad GEMM into main_grad, scale, reduce-scatter of the bucket: nothing is left to hide it); flash = the
  reduce-scatter inside the wgrad GEMM (ops/dp/wgrad_rs.py). compute = the same call on a fake group
  (transfers complete at once); comm = the same call with one token (same bytes, GEMM an outer product).
- "tp-nosp mlp": x [s, b, h] replicated -> column (n/P, all-reduce of dgrad in bwd) -> gelu -> row (all-reduce
  fwd) -> y [s, b, h] replicated: stock, data slicing k=2/4, flash with C sequence chunks
  (ops/tp_nosp/autograd.py); compute / comm as the harness: fake group / inner width 1.
- "megatron ddp": benchmarks/harness/megatron_rows.py `measure_ddp` (block time only).
exposed = block - compute; hidden = 1 - exposed / comm.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_flashoverlap.ops.dp.wgrad_rs import DPBucket, matmul_wgrad_reduce_scatter
from megatron_flashoverlap.runtime import OverlapContext
from benchmarks.harness import timing
from benchmarks.harness.blocks import Method, NoSPMlpBlock, Shape
from megatron_flashoverlap.runtime.timing import interleaved, rank_max, timed
from benchmarks.harness.estimator import speedup
from benchmarks.harness.verdict import speedup_text, tally

TP_METHODS = (Method("stock", "reference"), Method("slicing k=2", "slicing", 2),
              Method("slicing k=4", "slicing", 4), Method("flash C=2", "flash", 2), Method("flash C=4", "flash", 4),
              Method("flash_bidir C=2", "flash_bidir", 2))
DP_METHODS = (Method("stock", "reference"), Method("flash", "flash"), Method("flash_bidir", "flash_bidir"))


def _dp_variants(cfg: dict, fake) -> dict:
    """{(method, "bwd", measure): () -> seconds} of the wgrad + bucket reduce-scatter call."""
    world = dist.get_world_size()
    n, k, tokens = cfg["dp_n"], cfg["dp_k"], cfg["dp_tokens"]
    g = torch.Generator().manual_seed(dist.get_rank())
    full = (torch.randn(tokens, 1, n, generator=g), torch.randn(tokens, 1, k, generator=g))
    thin = (full[0][:1], full[1][:1])
    length = -(-(n * k) // (128 * world)) * 128 * world  # Megatron pads a bucket to lcm(DP, 128)
    grad = torch.zeros(length)
    ctx = OverlapContext(check_peers=False)

    def call(m, tensors, group):
        return lambda: timed(lambda: matmul_wgrad_reduce_scatter(*tensors, DPBucket(grad, 0, 1.0 / world), group,
                                                                 algo=m.algo, context=ctx))
    measured = {"block": (full, None), "compute": (full, fake), "comm": (thin, None)}
    return {(m.name, "bwd", key): call(m, t, grp) for m in DP_METHODS for key, (t, grp) in measured.items()}


def dp_rows(cfg: dict, fake) -> list[dict]:
    """wgrad [n, k] of `dp_tokens` rows + DP reduce-scatter of its bucket, per method."""
    stats = timing.combine(rank_max(interleaved(_dp_variants(cfg, fake), cfg["repeats"])))
    return [{"kind": "dp wgrad+RS", "seq": cfg["dp_tokens"], "method": m.name, "mode": "bwd",
             **timing.derived(stats, m.name, "bwd")} for m in DP_METHODS]


def tp_rows(cfg: dict, fake) -> list[dict]:
    world = dist.get_world_size()
    out = []
    for seq in cfg["seqs"]:
        runner = timing.Runner(NoSPMlpBlock.kind, Shape(seq, cfg["batch"], cfg["hidden"], cfg["width"]), world)
        stats = timing.combine(timing.measure(runner, TP_METHODS, cfg["repeats"], None, fake))
        out += [{"kind": "tp-nosp mlp", "seq": seq, "method": m.name, "mode": mode,
                 **timing.derived(stats, m.name, mode)} for m in TP_METHODS for mode in timing.MODES]
    return out


def main(rank: int, world: int, cfg: dict) -> dict | None:
    """The rank entry for `run_ranks`: every row kind; rank 0 returns {"config", "world", "rows"}."""
    from benchmarks.harness.megatron_rows import measure_ddp

    from benchmarks.harness.line_rate_rs import stock_reduce_scatter

    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    fake = timing.fake_group(world)
    with stock_reduce_scatter(cfg.get("stock_rs", "ring")):  # the references' and Megatron's reduce-scatters
        rows = dp_rows(cfg, fake)
        rows += measure_ddp(cfg["hidden"], cfg["width"], cfg["ddp_layers"], cfg["dp_tokens"], cfg["repeats"])
        rows += tp_rows(cfg, fake)
    return {"config": cfg, "world": world, "rows": rows} if rank == 0 else None


COLS = ("| rows | mode | size | method | block ms (min-max) | compute ms | comm ms | exposed ms | hidden [90% ci] | "
        "vs stock [90% ci] |\n|---|---|---|---|---|---|---|---|---|---|")


def _stock(run: dict) -> dict:
    """{(kind, seq, mode): stock's samples}: what every other method's speedup is taken against."""
    return {(r["kind"], r["seq"], r["mode"]): r["samples"] for r in run["rows"] if r["method"] == "stock"}


def table(run: dict) -> str:
    """One markdown table of a run's rows (nan cells as '-'): hidden with its 90 % round-bootstrap interval
    (harness/estimator.estimate, in derived), and the speedup over the stock row of each case with its interval
    (estimator.speedup: a win or LOSS only where it excludes 1.0)."""
    stock = _stock(run)
    lines = [COLS]
    for r in run["rows"]:
        lo, hi = r["spread"]
        size = f"{r['seq']} tokens" if "dp" in r["kind"] else f"s={r['seq']}"
        hl, hh = r.get("hidden_ci", (float("nan"), float("nan")))
        hidden = "-" if r["hidden"] != r["hidden"] else f"{r['hidden'] * 100:.0f}% [{hl * 100:.0f}-{hh * 100:.0f}]"
        vs = "-" if r["method"] == "stock" else speedup_text(speedup(stock[(r["kind"], r["seq"], r["mode"])],
                                                                    r["samples"]))
        line = (f"| {r['kind']} | {r['mode']} | {size} | {r['method']} | {r['block'] * 1e3:.1f} "
                f"({lo * 1e3:.1f}-{hi * 1e3:.1f}) | {r['compute'] * 1e3:.1f} | {r['comm'] * 1e3:.1f} | "
                f"{r['exposed'] * 1e3:.1f} | {hidden} | {vs} |")
        lines.append(line.replace("nan", "-"))
    return "\n".join(lines)


def summary(run: dict) -> list[str]:
    """Per row kind and non-stock method: wins / ties / losses against stock over its sizes and modes."""
    stock = _stock(run)
    cases = dict.fromkeys((r["kind"], r["method"]) for r in run["rows"] if r["method"] != "stock")
    return [f"- {kind} {m} vs stock: " + tally(speedup(stock[(r["kind"], r["seq"], r["mode"])], r["samples"])
                                               for r in run["rows"] if (r["kind"], r["method"]) == (kind, m))
            + " cases" for kind, m in cases]
