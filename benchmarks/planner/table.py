"""The comparison as markdown: summary per table, every point's predicted and measured time and error, the
winner checks (compare.py)."""
from __future__ import annotations

from benchmarks.planner import compare as C
from benchmarks.planner import settings as S

SECTIONS = (("overlap", "TP + SP MLP block (benchmarks/overlap)"), ("moe", "MoE layer (benchmarks/moe)"),
            ("topology", "decode all-reduce, two-level (benchmarks/topology)"))


def _pct(x: float) -> str:
    return f"{x * 100:+.0f} %"


def _summary_lines(rows, checks) -> list[str]:
    out = ["| table | points x methods | median abs error | max abs error | within 25 % | winners: agree / "
           "disagree / measured tie |", "|---|---|---|---|---|---|"]
    for key, title in SECTIONS + (("", "all"),):
        if not any(r["point"].startswith(key) for r in rows):
            continue
        s = C.summary(rows, key)
        out.append(f"| {title} | {s['n']} | {s['median_abs'] * 100:.1f} % | {s['max_abs'] * 100:.0f} % | "
                   f"{s['within_25']} / {s['n']} | {_winners(checks, key)} |")
    return out


def _winners(checks, key: str) -> str:
    if checks is None:
        return "-"
    ws = [w for w in checks if w["point"].startswith(key)]
    agree = sum(w["agree"] is True for w in ws)
    disagree = sum(w["agree"] is False for w in ws)
    ties = sum(w["agree"] is None for w in ws)
    return f"{agree} / {disagree} / {ties}" + (" (medians only)" if key == "topology" else "")


def _point_label(point: str) -> str:
    parts = point.split("|")
    if parts[0] == "overlap":
        return f"{parts[1]} s={parts[2]} {parts[3]} ({parts[4].split('/')[-1].replace('_raw.json', '')})"
    if parts[0] == "moe":
        return f"EP={parts[1]} {parts[2]} {parts[3]}"
    return f"P={parts[1]} {int(parts[2]) // 1024} KB"


def _rows_lines(rows) -> list[str]:
    out = ["| point | method | predicted ms | measured ms | error |", "|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {_point_label(r['point'])} | {r['method']} | {r['predicted'] * 1e3:.2f} | "
                   f"{r['measured'] * 1e3:.2f} | {_pct(r['error'])} |")
    return out


def _winner_lines(checks) -> list[str]:
    out = ["| point | pair | measured [90 % ci of the speedup] | predicted | agree |", "|---|---|---|---|---|"]
    for w in checks:
        ci = f" [{w['ci'][0]:.2f}, {w['ci'][1]:.2f}]" if w["ci"] else " (medians)"
        agree = "-" if w["agree"] is None else ("yes" if w["agree"] else "NO")
        out.append(f"| {_point_label(w['point'])} | {w['pair']} | {w['measured']}{ci} | {w['predicted']} | "
                   f"{agree} |")
    return out


COMMANDS = ("`python benchmarks/planner/run.py --rounds 5` (as root, with `nice -n -10`: calibrate, predict, compare); "
            "this file again from the committed calibration: `python benchmarks/planner/run.py --predict --compare "
            "--calibration benchmarks/planner/data/{name}`")


def render(preds: dict, meas: dict, cal: dict | None = None, name: str = "calibration.json") -> str:
    """preds: {statistic: predictions}; the first is the primary one (every point listed)."""
    stat, pred = next(iter(preds.items()))
    rows, checks = C.errors(pred, meas), C.winners(pred, meas)
    lines = ["# Planner on the CPU proxy: predicted vs measured", "",
             COMMANDS.format(name=name), "",
             "Every predicted figure is a PREDICTION of megatron_flashoverlap.plan calibrated on this proxy; every "
             "measured one is the committed table's median over rounds.", ""]
    for name, p in preds.items():
        lines += [f"## Summary: absolute times, calibration figures at their {name} over rounds", ""]
        lines += _summary_lines(C.errors(p, meas), C.winners(p, meas))
        lines += ["", f"## Summary: time relative to the point's baseline (stock; flash in the flash-only runs), "
                      f"calibration at its {name}", ""]
        lines += _summary_lines(C.ratio_errors(p, meas), None)
        lines += [""]
    if cal is not None:
        lines += ["## Calibration spread", ""] + spread_lines(cal) + [""]
    lines += [f"Every point below: calibration at its {stat}."]
    lines += ["", "## Not reproduced", ""] + [f"- {k}: {v}" for k, v in S.NOT_MODELLED.items()]
    lines += ["", "## Every point", ""] + _rows_lines(rows)
    lines += ["", "## Winners", ""] + _winner_lines(checks)
    return "\n".join(lines) + "\n"


def spread_lines(cal: dict) -> list[str]:
    """Per calibration run: its figures' count, rounds, and the spread (max - min) / min over rounds (median and
    worst over the figures)."""
    out = ["| calibration run | figures | rounds | spread (max - min) / min: median | worst |", "|---|---|---|---|---|"]
    for run, sections in cal.items():
        figs = [f for name, sec in sections.items() if isinstance(sec, dict) for f in sec.values()
                if isinstance(f, dict) and "lo" in f and f["lo"] > 0]
        if not figs:
            continue
        spreads = sorted((f["hi"] - f["lo"]) / f["lo"] for f in figs)
        out.append(f"| {run} | {len(figs)} | {figs[0]['n']} | {spreads[len(spreads) // 2] * 100:.0f} % | "
                   f"{spreads[-1] * 100:.0f} % |")
    return out
