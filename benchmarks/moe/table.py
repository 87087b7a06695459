"""The MoE benchmark's tables (pure: no process group): one row per method and mode of one (EP, link) run.

    run = {"world", "rate", "config", "rows": [{"method", "mode", "block", "compute", "comm", "exposed",
           "hidden", "hidden_ci", "bound", "bound_ci", "spread", "samples"}]}     (benchmarks/moe/rows.py)
    table(run)   -> markdown: | method | mode | block ms (min-max) | compute | comm | exposed | hidden [ci] |
                              to bound [ci] | vs stock [ci] |
    share(run, mode) -> stock's comm alone / stock's block: how much of stock's time the exchange is
    summary(runs) -> one line per non-stock method: wins / ties / losses vs stock over every (EP, link, mode)

vs stock = median(stock block) / median(row block) with its 90 % round-bootstrap interval
(harness/estimator.speedup): "win" only where the interval lies above 1.0, "LOSS" below, "tie" otherwise.
"""
from __future__ import annotations

from benchmarks.harness.estimator import speedup
from benchmarks.harness.verdict import speedup_text, word

HEAD = ("| method | mode | block ms (min-max) | compute ms | comm ms | exposed ms | hidden [90% ci] | "
        "to bound [90% ci] | vs stock [90% ci] |\n|---|---|---|---|---|---|---|---|---|")


def _stock(run: dict, mode: str) -> dict:
    for r in run["rows"]:
        if r["method"] == "stock" and r["mode"] == mode:
            return r
    raise ValueError(f"moe table: no stock row for mode {mode!r}; every run needs the stock method (benchmarks/moe/rows.py methods)")


def vs_stock(run: dict, row: dict) -> dict:
    """speedup of `row` over stock's row of the same mode (estimator.speedup on per-round block samples)."""
    return speedup(_stock(run, row["mode"])["samples"], row["samples"])


def share(run: dict, mode: str) -> float:
    """stock's comm alone / stock's block time in `mode` (the exchange's share of stock's time)."""
    st = _stock(run, mode)
    return st["comm"] / st["block"]


def _line(run: dict, r: dict) -> str:
    (lo, hi), (hl, hh), (bl, bh) = r["spread"], r["hidden_ci"], r["bound_ci"]
    s = vs_stock(run, r)
    vs = "-" if r["method"] == "stock" else speedup_text(s)
    return (f"| {r['method']} | {r['mode']} | {r['block'] * 1e3:.1f} ({lo * 1e3:.1f}-{hi * 1e3:.1f}) | "
            f"{r['compute'] * 1e3:.1f} | {r['comm'] * 1e3:.1f} | {r['exposed'] * 1e3:.1f} | "
            f"{r['hidden'] * 100:.0f}% [{hl * 100:.0f}-{hh * 100:.0f}] | {r['bound']:.2f}x [{bl:.2f}-{bh:.2f}] | "
            f"{vs} |")


def table(run: dict) -> str:
    """The markdown table of one run, rows in the run's order (module docstring)."""
    return "\n".join([HEAD] + [_line(run, r) for r in run["rows"]])


def header(run: dict) -> str:
    """EP, link, shapes, and the exchange's share of stock's time per mode."""
    c, world = run["config"], run["world"]
    cores = f"; {world} ranks share this machine's cores" if world > 2 else ""
    shares = ", ".join(f"{mode} {share(run, mode) * 100:.0f}%" for mode in ("fwd", "fwd+bwd"))
    picked = "".join(f"; {m} ran {p} (its start-up measurement)" for m, p in run.get("picked", {}).items())
    return (f"EP={world}, link {run['rate']}{cores}: tokens/rank {c['tokens']}, hidden {c['hidden']}, expert ffn "
            f"{c['ffn']}, {c['experts']} experts, top-{c['topk']}, fp32, {c['repeats']} rounds; stock's comm "
            f"alone / stock's block: {shares}{picked}")


def summary(runs: list[dict]) -> list[str]:
    """Per non-stock method: wins / ties / losses vs stock over every (EP, link, mode) point, losses named."""
    names = [m for m in dict.fromkeys(r["method"] for run in runs for r in run["rows"]) if m != "stock"]
    lines = []
    for name in names:
        pts = [(run, r, vs_stock(run, r)) for run in runs for r in run["rows"] if r["method"] == name]
        words = [word(s) for _, _, s in pts]
        lost = [f"EP={run['world']} {run['rate']} {r['mode']}" for run, r, s in pts if s["loss"]]
        lines.append(f"- {name} vs stock: {words.count('win')} wins, {words.count('tie')} ties (interval contains "
                     f"1.0), {words.count('LOSS')} losses of {len(words)} points"
                     + (f"; losses at {', '.join(lost)}" if lost else ""))
    return lines
