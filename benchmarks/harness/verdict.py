"""The verdict of a sweep: flash against stock and against the best slicing k at EVERY swept point, losses
included, each speedup with its 90 % bootstrap interval (benchmarks/harness/estimator.py).

    | link | block | seq | comm/compute | flash hidden [ci] | to bound [ci] | vs stock [ci] | vs best slicing [ci] |
    win  = the interval lies above 1.0; loss = below 1.0; tie = it contains 1.0 (no claim either way)
    summary(runs) -> the lines the README quotes: wins / ties / losses of each comparison over all points
    tally(speedups) -> "W wins, T ties, L losses of N": a list of estimator.speedup results counted by word
"""
from __future__ import annotations

from benchmarks.harness.estimator import speedup

HEAD = ["| link | block | seq | comm/compute (stock) | flash hidden [90% ci] | flash to bound [90% ci] | "
        "flash vs stock [90% ci] | best slicing | flash vs best slicing [90% ci] |",
        "|---|---|---|---|---|---|---|---|---|"]


def word(s: dict) -> str:
    """An estimator.speedup as a verdict: win / LOSS only where its interval excludes 1.0, else tie."""
    return "win" if s["win"] else ("LOSS" if s["loss"] else "tie")


def tally(speedups) -> str:
    """'2 wins, 1 ties, 0 losses of 3' (module docstring)."""
    words = [word(s) for s in speedups]
    return (f"{words.count('win')} wins, {words.count('tie')} ties, {words.count('LOSS')} losses "
            f"of {len(words)}")


def speedup_text(s: dict) -> str:
    """'1.26x [1.22-1.39] win'."""
    return f"{s['ratio']:.2f}x [{s['ci'][0]:.2f}-{s['ci'][1]:.2f}] {word(s)}"


def point_rows(run: dict, kind: str, mode: str) -> list[dict]:
    """Per swept sequence length with a flash row: its comparisons (speedup dicts) and the rows used."""
    out = []
    for seq in run["config"]["seqs"]:
        rs = {r["method"]: r for r in run["rows"] if r["kind"] == kind and r["mode"] == mode and r["seq"] == seq}
        if "flash" not in rs or "stock" not in rs:
            continue
        f, st = rs["flash"], rs["stock"]
        sl = {n: r for n, r in rs.items() if n.startswith("slicing")}
        best = min(sl, key=lambda n: sl[n]["block"]) if sl else None
        out.append({"rate": run["rate"], "kind": kind, "mode": mode, "seq": seq, "flash": f, "best": best,
                    "comm_ratio": st["comm"] / st["compute"], "vs_stock": speedup(st["samples"], f["samples"]),
                    "vs_slicing": speedup(sl[best]["samples"], f["samples"]) if best else None})
    return out


def verdict(run: dict, kind: str, mode: str) -> list[str]:
    """One markdown row per swept point (HEAD)."""
    lines = []
    for p in point_rows(run, kind, mode):
        f, (hl, hh), (bl, bh) = p["flash"], p["flash"]["hidden_ci"], p["flash"]["bound_ci"]
        vs = speedup_text(p["vs_slicing"]) if p["vs_slicing"] else "-"
        lines.append(f"| {p['rate']} | {kind} {mode} | {p['seq']} | {p['comm_ratio']:.2f} | "
                     f"{f['hidden'] * 100:.0f}% [{hl * 100:.0f}-{hh * 100:.0f}] | {f['bound']:.2f}x "
                     f"[{bl:.2f}-{bh:.2f}] | {speedup_text(p['vs_stock'])} | {p['best'] or '-'} | {vs} |")
    return lines


def summary(runs: list[dict]) -> list[str]:
    """Wins / ties / losses of flash vs stock and vs the best slicing k over every swept point."""
    pts = [p for run in runs for kind in run["config"]["kinds"] for mode in ("fwd", "fwd+bwd")
           for p in point_rows(run, kind, mode)]
    lines = []
    for key, name in (("vs_stock", "stock"), ("vs_slicing", "the best slicing k")):
        words = [word(p[key]) for p in pts if p[key] is not None]
        lost = [f"{p['rate']} {p['kind']} {p['mode']} s={p['seq']}" for p in pts
                if p[key] is not None and p[key]["loss"]]
        lines.append(f"- flash vs {name}: {words.count('win')} wins, {words.count('tie')} ties (interval "
                     f"contains 1.0), {words.count('LOSS')} losses of {len(words)} points"
                     + (f"; losses at {', '.join(lost)}" if lost else ""))
    return lines
