"""The GPT DDP table of benchmarks/dp/run.py from one run's samples (benchmarks/dp/gpt.py), through
benchmarks/harness/estimator.py.

    rows(run) -> [{"arm", "buckets", "fused", "step", "free", "exposed", "hidden", "hidden_ci", "tail",
                   "vs_ref", "vs_best", "exposed_ratio", "bound"}]
        ref of an arm     the stock arm with the same bucket size ("stock" or "stock, small buckets")
        exposed           median(step) - median(free): what the DP gradient reduction adds to a step
        hidden            1 - exposed / median(comm alone)                         [90 % bootstrap interval]
        vs_ref / vs_best  estimator.speedup(ref step, arm step) / against the faster stock arm
        exposed_ratio     exposed(arm) / exposed(ref) with its bootstrap interval (rounds resampled jointly)
        bound             the link bound: max(0, median(comm alone) - median(arm's DP-free backward)), the least
                          any schedule can expose (the reduction can overlap backward only); None in runs
                          recorded before the backward was sampled
    host_floor(run) -> seconds | None: median over rounds of the reduction's CPU time alone summed over the
        ranks, / the cores (where the ranks fill them: compute keeps every core busy, so even a perfectly
        overlapped reduction lengthens the step by about this much); an estimate, not a bound
    table(run) -> markdown; verdict(run) -> the lines that judge the targets (win/loss only outside the interval)
"""
from __future__ import annotations

import functools
import math
import statistics

from benchmarks.harness.estimator import bootstrap, estimate, speedup
from benchmarks.harness.verdict import speedup_text

TARGET_EXPOSED = 0.20  # issue 14: exposed DP communication at most 20 % of stock's
OURS = ("ours, auto", "ours, auto, small buckets", "ours, auto, ring in bwd", "ours, auto, worker")


def _ref(arm: str) -> str:
    return "stock, small buckets" if arm.endswith("small buckets") else "stock"


def _exposed(step, free) -> float:
    return statistics.median(step) - statistics.median(free)


def exposed_ratio(arm: dict, ref: dict) -> dict:
    """exposed(arm) / exposed(ref) and its interval; nan where the reference exposes nothing; a resample in
    which the reference exposes nothing counts as +inf (no finite ratio; NaN would break the sort)."""
    def ratio(s, f, rs, rf, empty=math.nan):
        base = _exposed(rs, rf)
        return _exposed(s, f) / base if base > 0 else empty
    lists = (arm["step"], arm["free"], ref["step"], ref["free"])
    return {"ratio": ratio(*lists), "ci": bootstrap(functools.partial(ratio, empty=math.inf), *lists)}


def rows(run: dict) -> list[dict]:
    arms, comm = run["arms"], run["comm"]
    best = min([n for n in ("stock", "stock, small buckets") if n in arms], key=lambda n: statistics.median(arms[n]["step"]))
    out = []
    for name, a in arms.items():
        est = estimate(a["step"], a["free"], comm)
        ref = arms[_ref(name)]
        out.append({"arm": name, "buckets": len(a["buckets"]), "fused": len(a["fused"]), "step": est["block"],
                    "spread": (min(a["step"]), max(a["step"])), "free": est["compute"], "exposed": est["exposed"],
                    "hidden": est["hidden"], "hidden_ci": est["hidden_ci"], "tail": statistics.median(a["tail"]),
                    "vs_ref": speedup(ref["step"], a["step"]), "vs_best": speedup(arms[best]["step"], a["step"]),
                    "best": best, "exposed_ratio": exposed_ratio(a, ref), "bound": link_bound(a, comm)})
    return out


def link_bound(arm: dict, comm: list) -> float | None:
    """Seconds no overlap can hide: the stock reduction alone minus the backward it may overlap."""
    if not arm.get("bwd"):
        return None
    return max(0.0, statistics.median(comm) - statistics.median(arm["bwd"]))


HEAD = ("| arm | buckets | fused | step ms (min-max) | DP-free step ms | exposed DP ms | hidden [90% ci] | "
        "tail after bwd ms | vs stock, same buckets [90% ci] | exposed / stock's [90% ci] | link bound ms |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|")


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.0f}"


def table(run: dict) -> str:
    lines = [HEAD]
    for r in rows(run):
        er, (hl, hh) = r["exposed_ratio"], r["hidden_ci"]
        lines.append(f"| {r['arm']} | {r['buckets']} | {r['fused']} | {r['step'] * 1e3:.0f} "
                     f"({r['spread'][0] * 1e3:.0f}-{r['spread'][1] * 1e3:.0f}) | {r['free'] * 1e3:.0f} | "
                     f"{r['exposed'] * 1e3:.0f} | {r['hidden'] * 100:.0f}% [{hl * 100:.0f}-{hh * 100:.0f}] | "
                     f"{r['tail'] * 1e3:.0f} | {speedup_text(r['vs_ref'])} | "
                     f"{er['ratio']:.2f} [{er['ci'][0]:.2f}-{er['ci'][1]:.2f}] | {_ms(r['bound'])} |")
    return "\n".join(lines)


def verdict(run: dict, label: str) -> list[str]:
    """Per automatic-choice arm: step time vs both stock arms (a loss only where the interval is below 1)
    and the exposed ratio against TARGET_EXPOSED (met where the interval's upper end is at most the target)."""
    out, table_rows, floor = [], rows(run), host_floor(run)
    rows_by_arm = {r["arm"]: r for r in table_rows}
    for r in table_rows:
        if r["arm"] not in OURS:
            continue
        er = r["exposed_ratio"]
        slow = r["vs_ref"]["loss"] or r["vs_best"]["loss"]
        if math.isnan(er["ratio"]):  # (a resample's empty reference is +inf in the interval, never NaN)
            met = "undefined: stock's median exposed time is not above 0"
        elif er["ratio"] > TARGET_EXPOSED:
            met = "MISSED" + _unreachable(r, rows_by_arm[_ref(r["arm"])], floor)
        else:
            met = "met" if er["ci"][1] <= TARGET_EXPOSED else "point met, interval not"
        out.append(f"- {label}, {r['arm']}: step vs {_ref(r['arm'])} {speedup_text(r['vs_ref'])}, vs the faster stock "
                   f"({r['best']}) {speedup_text(r['vs_best'])}: {'SLOWER' if slow else 'no slower'}; exposed DP "
                   f"{er['ratio']:.2f} of stock's [{er['ci'][0]:.2f}-{er['ci'][1]:.2f}] "
                   f"(target <= {TARGET_EXPOSED:.2f}: {met})")
    return out


def host_floor(run: dict) -> float | None:
    cores = run.get("cores")
    if not run.get("comm_cpu") or not cores or run.get("world", 0) < cores:
        return None
    return statistics.median(run["comm_cpu"]) / cores


def _unreachable(r: dict, ref: dict, floor: float | None) -> str:
    """', below the link bound (...)' where the target asks for less than any schedule can expose, else
    ', below the host floor (...)' where it asks for less than the host's own share of the bytes."""
    allowed = TARGET_EXPOSED * ref["exposed"]
    if r["bound"] is not None and r["bound"] > allowed:
        return (f", below the link bound: the target allows {allowed * 1e3:.0f} ms, no schedule exposes less than "
                f"{r['bound'] * 1e3:.0f} ms (comm alone - backward)")
    if floor is not None and floor > allowed:
        return (f", below the host floor: the target allows {allowed * 1e3:.0f} ms, the reduction's own CPU time "
                f"on these cores is about {floor * 1e3:.0f} ms")
    return ""
