"""The one-window run as markdown (run.py --one-window; again from its raw file with --window FILE): the scores
against the targets, the noise of the window, every point and every winner check (score.py).

    render(raw, name) -> markdown   raw: one_window.py's output; name: its file name, for the command line
"""
from __future__ import annotations

import statistics

from benchmarks.planner import score as C
from benchmarks.planner import settings as S
from benchmarks.planner.window_predict import predict_window

KINDS = (("mlp", "TP + SP MLP block"), ("mlp_nosp", "TP without SP MLP block (all-reduce)"), ("moe", "MoE layer"),
         ("all_reduce", "decode all-reduce, two-level"))
COMMAND = "nice -n -10 python benchmarks/planner/run.py --one-window --rounds {rounds} --passes {passes}"
AGAIN = "python benchmarks/planner/run.py --one-window --compare --window benchmarks/planner/data/{name}"


def command(raw: dict) -> str:
    """The command that measured `raw`: COMMAND, and --only with the windows it ran where it ran fewer than all."""
    names = [w["name"] for w in raw["windows"]]
    run_all = names == [spec[0] for spec in S.WINDOWS]
    return COMMAND.format(**raw) + ("" if run_all else " --only " + " ".join(f'"{n}"' for n in names))


def _pct(x: float) -> str:
    return f"{x * 100:+.1f} %"


def _summary_line(title: str, s: dict) -> str:
    scored = s["agree"] + s["disagree"]
    share = f" ({s['agree'] / scored * 100:.1f} %)" if scored else ""  # one decimal: 94.6 % is not 95 %
    return (f"| {title} | {s['n']} | {s['median_abs'] * 100:.1f} % | {s['max_abs'] * 100:.1f} % | "
            f"{s['within_25']} / {s['n']} | {s['agree']} / {scored}{share}, {s['ties']} ties |")


def summary_lines(rows: list, checks: list) -> list[str]:
    out = ["| points of | points x modes x methods | median abs error | max abs error | within 25 % | winner right "
           "(not a measured tie) |", "|---|---|---|---|---|---|"]
    for kind, title in KINDS:
        sub = [r for r in rows if f"/ {kind} " in r["point"]]
        if sub:
            out.append(_summary_line(title, C.summary(sub, [c for c in checks if f"/ {kind} " in c["point"]])))
    s = C.summary(rows, checks)
    out.append(_summary_line("all", s))
    met = C.met(s)
    out += ["", "Targets: median abs error <= 10 % ({}), none beyond 25 % ({}), winner right >= 95 % ({}).".format(
        *("met" if met[k] else "missed" for k in ("median_abs", "max_abs", "winners")))]
    return out


def _noise_lines(raw: dict, rows: list) -> list[str]:
    out = ["| window | ranks | run s | points | rounds spread (max - min) / min: median / worst | prediction drift "
           "across a point (after / before - 1): median abs / worst | probe figures across the window's "
           "calibrations, (max - min) / min: median / worst |", "|---|---|---|---|---|---|---|"]
    for win in raw["windows"]:
        sub = [r for r in rows if r["window"] == win["name"]]
        spread = sorted(r["spread"] for r in sub)
        drift = sorted(abs(r["drift"]) for r in sub)
        probe = sorted(_probe_spread(win["calibrations"]))
        out.append(f"| {win['name']} | {win['world']} | {win['seconds']:.0f} | {len(win['points'])} | "
                   f"{statistics.median(spread) * 100:.0f} % / {spread[-1] * 100:.0f} % | "
                   f"{statistics.median(drift) * 100:.1f} % / {drift[-1] * 100:.0f} % | "
                   f"{statistics.median(probe) * 100:.0f} % / {probe[-1] * 100:.0f} % |")
    return out


def _probe_spread(cals: list) -> list[float]:
    """(max - min) / min over the calibrations of every probe figure (GEMM, hop, stock rows)."""
    series: dict = {}
    for cal in cals:
        pr = cal["probe"]
        for m, k, n, s in pr["gemm"]:
            series.setdefault(("gemm", m, k, n), []).append(s)
        for part in ("intra", "inter"):
            for b, s in pr[part]:
                series.setdefault((part, b), []).append(s)
        for kind, rows in pr.get("stock", {}).items():
            for b, s in rows:
                series.setdefault((kind, b), []).append(s)
    return [(max(v) - min(v)) / min(v) for v in series.values() if min(v) > 0] or [0.0]


def _point_lines(rows: list) -> list[str]:
    out = ["| point | mode | method | predicted ms (before, after) | measured ms | rounds spread | error |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['point']} | {r['mode']} | {r['method']} | {r['predicted'] * 1e3:.2f} "
                   f"({r['before'] * 1e3:.2f}, {r['after'] * 1e3:.2f}) | {r['measured'] * 1e3:.2f} | "
                   f"{r['spread'] * 100:.0f} % | {_pct(r['error'])} |")
    return out


def _check_lines(checks: list) -> list[str]:
    out = ["| point | mode | pair | measured speedup [90 % ci] | measured | predicted | agree |",
           "|---|---|---|---|---|---|---|"]
    for c in checks:
        agree = "-" if c["agree"] is None else ("yes" if c["agree"] else "NO")
        out.append(f"| {c['point']} | {c['mode']} | {c['pair']} | {c['ratio']:.3f} [{c['ci'][0]:.3f}, "
                   f"{c['ci'][1]:.3f}] | {c['measured']} | {c['predicted']} | {agree} |")
    return out


def render(raw: dict, name: str = "window.json") -> str:
    preds = [predict_window(w) for w in raw["windows"]]
    measured = C.verdicts(raw["windows"])
    rows, checks = C.errors(raw["windows"], preds), C.checks(raw["windows"], preds, measured=measured)
    lines = ["# Planner on the CPU proxy, one window: predicted vs measured in the same run", "",
             f"Run: `{command(raw)}` ({raw['seconds']:.0f} s); this file again from its raw data: "
             f"`{AGAIN.format(name=name)}`", "",
             "Every predicted figure is a PREDICTION of megatron_flashoverlap.plan on the proxy built from the "
             "chooser's start-up probe (megatron/probe.py): the mean of the predictions from the calibration just "
             "before the point and the one just after it; every measured one is the point's median over its "
             "rounds.", "",
             "## Scores", ""]
    lines += summary_lines(rows, checks)
    for which in ("before", "after"):
        lines += ["", f"## Scores from the calibration just {which} each point alone", ""]
        lines += summary_lines(C.errors(raw["windows"], preds, which),
                               C.checks(raw["windows"], preds, which, measured))
    lines += ["", "## Noise of the window", ""] + _noise_lines(raw, rows)
    lines += ["", "## Not in the window", ""] + [f"- {k}: {v}" for k, v in S.WINDOW_NOT_MODELLED.items()]
    lines += ["", "## Every point", ""] + _point_lines(rows)
    lines += ["", "## Winners", ""] + _check_lines(checks)
    return "\n".join(lines) + "\n"
