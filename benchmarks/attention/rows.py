"""Rank side of benchmarks/attention/run.py: the attention blocks (benchmarks/attention/blocks.py) per method and mode.

    run_ranks("benchmarks.attention.rows:main", P, args=(cfg,))[0] -> {"config", "world", "rows"}
    cfg: {"seq", "batch", "hidden", "width", "head_dim", "repeats"}

Per block kind, one interleaved loop (runtime/timing.py) over method x mode x measure, one warm-up round:
    block    the block on the real group
    compute  the same block on torch's fake process group (every transfer is free)
    comm     qsa: the block at width 1 (same bytes); ulysses: its two exchanges only (`comm_alone`), doubled
             for fwd+bwd (the backward repeats both exchanges, the duals)
A row keeps each measure's per-round seconds (the max over ranks); the table (`table`) gives the medians, exposed =
block - compute, hidden = 1 - exposed / comm with its 90 % round-bootstrap interval (harness/estimator.estimate),
and the speedup over stock's block with its interval (estimator.speedup: a win or LOSS only where it excludes 1.0).
"""
from __future__ import annotations

import torch

from megatron_flashoverlap.runtime import OverlapContext
from benchmarks.attention.blocks import ATTENTION_BLOCKS
from benchmarks.harness.blocks import Shape, comm_only, method_by_name
from benchmarks.harness.estimator import estimate, speedup
from benchmarks.harness.verdict import speedup_text, tally
from megatron_flashoverlap.runtime.timing import interleaved, pass_seconds, rank_max
from benchmarks.harness.timing import MEASURES, MODES, fake_group

KINDS = {"qsa": ["stock", "slicing k=2", "slicing k=4", "flash", "flash_bidir"],
         "qsa_zigzag": ["stock", "flash"], "ulysses": ["stock", "flash"]}


def _call(block, x, group, method, ctx, mode, comm_alone=False) -> float:
    """Seconds of one block call (comm alone: the two exchanges, forward only)."""
    if comm_alone:
        return pass_seconds(lambda xx: block.comm_alone(xx, group, method, ctx), x, "fwd")
    return pass_seconds(lambda xx: block.forward(xx, group, method, ctx), x, mode, None, block.params())


def _variants(kind: str, shape: Shape, world: int, fake, ctx) -> dict:
    """{(method, mode, measure): () -> seconds} of one block kind."""
    block = ATTENTION_BLOCKS[kind](shape, world)
    ulysses = kind == "ulysses"
    thin = block if ulysses else ATTENTION_BLOCKS[kind](comm_only(shape), world)
    x = block.input()
    out = {}
    for name in KINDS[kind]:
        m = method_by_name(name)
        for mode in MODES:
            calls = {"block": (block, None, False), "compute": (block, fake, False), "comm": (thin, None, ulysses)}
            for key, (b, g, alone) in calls.items():
                out[(name, mode, key)] = lambda b=b, g=g, a=alone, m=m, mode=mode: _call(b, x, g, m, ctx, mode, a)
    return out


def main(rank: int, world: int, cfg: dict) -> dict | None:
    """The rank entry for `run_ranks`: every kind's rows; rank 0 returns {"config", "world", "rows"}."""
    from benchmarks.harness.line_rate_rs import stock_reduce_scatter

    torch.set_num_threads(1)
    with stock_reduce_scatter(cfg.get("stock_rs", "ring")):  # the query-split reference's reduce-scatter
        return _rows(rank, world, cfg)


def _rows(rank: int, world: int, cfg: dict) -> dict | None:
    fake = fake_group(world)
    shape = Shape(cfg["seq"], cfg["batch"], cfg["hidden"], cfg["width"], cfg["head_dim"])
    ctx = OverlapContext(check_peers=False)
    rows = []
    for kind, methods in KINDS.items():
        rounds = rank_max(interleaved(_variants(kind, shape, world, fake, ctx), cfg["repeats"]))
        for name in methods:
            for mode in MODES:
                t = {k: list(rounds[(name, mode, k)]) for k in MEASURES}
                if kind == "ulysses" and mode != "fwd":
                    t["comm"] = [2 * x for x in t["comm"]]  # backward repeats both exchanges (the duals)
                rows.append({"kind": kind, "method": name, "mode": mode, **t})
    return {"config": cfg, "world": world, "rows": rows} if rank == 0 else None


def _stock(res: dict) -> dict:
    """{(kind, mode): stock's block seconds per round}: what every other method's speedup is taken against."""
    return {(r["kind"], r["mode"]): r["block"] for r in res["rows"] if r["method"] == "stock"}


def table(res: dict) -> str:
    """The markdown table of one run's rows (module docstring), in the run's order."""
    out = ["| block | method | mode | block ms (min-max) | compute ms | comm ms | exposed ms | hidden [90% ci] | "
           "vs stock [90% ci] |", "|---|---|---|---|---|---|---|---|---|"]
    stock = _stock(res)
    for r in res["rows"]:
        e = estimate(r["block"], r["compute"], r["comm"])
        lo, hi = e["hidden_ci"]
        vs = "-" if r["method"] == "stock" else speedup_text(speedup(stock[(r["kind"], r["mode"])], r["block"]))
        out.append(f"| {r['kind']} | {r['method']} | {r['mode']} | {e['block'] * 1e3:.1f} "
                   f"({min(r['block']) * 1e3:.1f}-{max(r['block']) * 1e3:.1f}) | {e['compute'] * 1e3:.1f} | "
                   f"{e['comm'] * 1e3:.1f} | {e['exposed'] * 1e3:.1f} | {e['hidden'] * 100:.0f}% "
                   f"[{lo * 100:.0f}-{hi * 100:.0f}] | {vs} |")
    return "\n".join(out)


def summary(res: dict) -> list[str]:
    """Per block kind and non-stock method: wins / ties / losses against stock over the modes."""
    stock = _stock(res)
    return [f"- {kind} {name} vs stock: " + tally(speedup(stock[(kind, r["mode"])], r["block"]) for r in res["rows"]
                                                  if r["kind"] == kind and r["method"] == name) + " modes"
            for kind, methods in KINDS.items() for name in methods[1:]]
