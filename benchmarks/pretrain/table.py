"""benchmarks/pretrain/run.py's figures and tables from the parsed runs (benchmarks/pretrain/rows.py).

    summarize(runs, warmup) -> {"arms": {arm: {"samples", "median", "vs_stock", "sites", "phases"}},
                                "loss": {arm: [lm loss per iteration]}, "max_loss_diff": {arm: float},
                                "comm": {"fraction", "ci"} or None}
        runs: {arm: [merged parse per round]}, rounds in the order they ran
        vs_stock: harness/estimator.speedup(stock samples, arm samples) (win only where the interval excludes 1);
                  a "+heap" arm against stock+heap where the run has it (baseline)
        comm.fraction: 1 - median(stock@unshaped) / median(stock): the share of stock's iteration the link costs
    table(s) / breakdown_table(s) / loss_table(s) -> markdown
"""
from __future__ import annotations

import collections
import statistics

from benchmarks.harness.estimator import speedup
from benchmarks.harness.verdict import word
from benchmarks.pretrain.rows import ARMS, BASE, FAST, HEAP_SUFFIX, PHASES, base_arm, phases, run_stat


def _curve(parsed: dict) -> list[float]:
    return [parsed["loss"][i] for i in sorted(parsed["loss"])]


def _max_diff(ref: list[float], runs: list[dict]) -> float:
    """max |loss - ref| over every run's iterations (a run with other iterations than ref: ValueError)."""
    worst = 0.0
    for parsed in runs:
        curve = _curve(parsed)
        if len(curve) != len(ref):
            raise ValueError(f"a run logged {len(curve)} losses where stock logged {len(ref)}: the arms must "
                             f"train the same iterations (same --iters)")
        worst = max([worst] + [abs(a - b) for a, b in zip(curve, ref)])
    return worst


def _arm(runs: list[dict], warmup: int) -> dict:
    samples = [run_stat(p, warmup) for p in runs]
    per_round = [phases(p, warmup) for p in runs]
    names = [n for n in PHASES if all(n in r for r in per_round)]
    return {"samples": samples, "median": statistics.median(samples),
            "sites": runs[0]["sites"] or "stock", "picks": _picks(runs),
            "phases": {n: statistics.median(r[n] for r in per_round) for n in names}}


def _picks(runs: list[dict]) -> dict:
    """{choice key: {pick: runs}} over an arm's runs (empty where none chose: samples from before picks were
    kept, or no auto site)."""
    out: dict = collections.defaultdict(collections.Counter)
    for run in runs:
        for key, pick in run.get("picks", {}).items():
            out[key][pick] += 1
    return {key: dict(counts) for key, counts in out.items()}


def picks_line(s: dict) -> str:
    """What each auto arm's chooser picked per key over the rounds, one line per arm that chose, e.g.
    `- auto, the chooser's picks over 5 runs: fc1/train/512 flash 5; qkv/train/512 flash 4, reference 1`."""
    lines = []
    for arm, a in s["arms"].items():
        if a.get("picks"):
            body = "; ".join(f"{key} " + ", ".join(f"{p} {n}" for p, n in sorted(counts.items()))
                             for key, counts in sorted(a["picks"].items()))
            lines.append(f"- {arm}, the chooser's picks over {len(a['samples'])} runs: {body}")
    return "\n".join(lines)


def _comm(arms: dict) -> dict | None:
    if FAST not in arms or BASE not in arms:
        return None
    s = speedup(arms[BASE]["samples"], arms[FAST]["samples"])
    return {"fraction": 1 - 1 / s["ratio"], "ci": (1 - 1 / s["ci"][0], 1 - 1 / s["ci"][1])}


def reference(arms) -> str:
    """The arm every other is compared with at the last: stock, else stock+heap (a run of "+heap" arms alone)."""
    for ref in (BASE, BASE + HEAP_SUFFIX):
        if ref in arms:
            return ref
    raise ValueError(f"no {BASE!r} or {BASE + HEAP_SUFFIX!r} arm: every comparison is against stock; keep one of "
                     "them in --arms")


def baseline(arm: str, runs: dict, ref: str) -> str:
    """What `arm` is compared with: stock+heap for another "+heap" arm where the run has it (the same heap on
    both sides, harness/launch.py HEAP), else the run's reference `ref`."""
    heap = BASE + HEAP_SUFFIX
    return heap if arm.endswith(HEAP_SUFFIX) and arm != heap and heap in runs else ref


def summarize(runs: dict, warmup: int) -> dict:
    """The figures of one benchmark (module docstring); `runs` must hold stock or stock+heap (`reference`)."""
    ref = reference([a for a, r in runs.items() if r])
    arms = {a: _arm(r, warmup) for a, r in runs.items()}
    for a, arm in arms.items():
        arm["baseline"] = baseline(a, runs, ref)
        arm["vs_stock"] = None if a == ref else speedup(arms[arm["baseline"]]["samples"], arm["samples"])
    curve = _curve(runs[ref][0])
    return {"arms": arms, "reference": ref, "loss": {a: _curve(r[0]) for a, r in runs.items()},
            "max_loss_diff": {a: _max_diff(curve, r) for a, r in runs.items()}, "comm": _comm(arms)}


def _against(a: dict) -> str:
    return "" if a.get("baseline", BASE) == BASE or a["vs_stock"] is None else f" (vs {a['baseline']})"


def _vs(s: dict | None) -> str:
    if s is None:
        return "1.00x (baseline)"
    return f"{s['ratio']:.2f}x [{s['ci'][0]:.2f}, {s['ci'][1]:.2f}] {word(s)}"


def table(s: dict, rate: str) -> str:
    """| arm | link | median iteration ms [min-max over rounds] | vs stock [90 % ci] | max |dloss| | GEMM sites |"""
    rows = ["| arm | link | median iteration ms (min-max of rounds) | rounds | vs stock [90 % ci] | "
            "max abs lm-loss diff vs stock | GEMM sites |", "|---|---|---|---|---|---|---|"]
    for arm, a in s["arms"].items():
        ms = [x * 1e3 for x in a["samples"]]
        link = rate if ARMS[base_arm(arm)][1] == "rate" else "unshaped"
        rows.append(f"| {arm} | {link} | {a['median'] * 1e3:.0f} ({min(ms):.0f}-{max(ms):.0f}) | {len(ms)} | "
                    f"{_vs(a['vs_stock'])}{_against(a)} | {s['max_loss_diff'][arm]:.1e} | {a['sites']} |")
    picks = picks_line(s)
    if picks:
        rows += ["", picks]
    if s["comm"]:
        c = s["comm"]
        rows += ["", f"Communication share of stock's iteration at {rate}: 1 - stock@unshaped / stock = "
                     f"{c['fraction'] * 100:.0f} % [90 % ci {c['ci'][0] * 100:.0f}, {c['ci'][1] * 100:.0f}]"]
    return "\n".join(rows)


def breakdown_table(s: dict) -> str:
    """Megatron's per-phase timers (max over ranks), medians over kept iterations and rounds, in ms."""
    names = [n for n in PHASES if any(n in a["phases"] for a in s["arms"].values())]
    rows = ["| arm | " + " | ".join(names) + " | iteration |", "|---" * (len(names) + 2) + "|"]
    for arm, a in s["arms"].items():
        cells = [f"{a['phases'][n]:.0f}" if n in a["phases"] else "-" for n in names]
        rows.append(f"| {arm} | " + " | ".join(cells) + f" | {a['median'] * 1e3:.0f} |")
    return "\n".join(rows)


def loss_table(s: dict) -> str:
    """lm loss per iteration, one column per arm (round 0 of each arm; every round is in max_loss_diff)."""
    arms = list(s["loss"])
    rows = ["| iteration | " + " | ".join(arms) + " |", "|---" * (len(arms) + 1) + "|"]
    for i in range(len(s["loss"][s.get("reference", BASE)])):
        rows.append(f"| {i + 1} | " + " | ".join(f"{s['loss'][a][i]:.6f}" for a in arms) + " |")
    return "\n".join(rows)
