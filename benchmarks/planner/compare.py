"""Predicted against measured, point by point: the committed tables' medians and per-round samples are read
here, after the predictions are made (predict.py never sees them).

    measured(root) -> {point: {method: {"median", "samples" or None}}}
    compare(pred, meas) -> rows (point, method, predicted, measured, error) and winner checks
    winner check: per pair (flash vs stock; flash vs the best slicing k; c=2 and c=4 vs c=1 where only flash
    rows count; MoE flash vs stock) the measured verdict (harness/estimator.speedup: its 90 % interval excludes
    1.0) against the predicted faster one; a measured tie is listed, never scored. The topology table keeps
    medians only (no rounds): its winners are compared on medians and labelled so.
"""
from __future__ import annotations

import json
import os
import statistics

from benchmarks.harness.estimator import speedup
from benchmarks.planner import settings as S


def _load(root: str, rel: str):
    with open(os.path.join(root, rel)) as f:
        return json.load(f)


def _overlap(root: str) -> dict:
    out = {}
    for raw, rate, seqs, _, _, methods in S.OVERLAP:
        data = _load(root, raw)
        run = next(r for r in data["seq_runs"] + data["rate_runs"] if r["rate"] == rate and
                   set(seqs) <= set(r["config"]["seqs"]))
        for seq in seqs:
            for mode in S.MODES:
                rows = {r["method"]: r for r in run["rows"] if r["kind"] == "mlp" and r["seq"] == seq and
                        r["mode"] == mode}
                out[f"overlap|{rate}|{seq}|{mode}|{raw}"] = {
                    m: {"median": rows[m]["block"], "samples": rows[m]["samples"]} for m in methods}
    return out


def _moe(root: str) -> dict:
    out = {}
    for run in _load(root, S.MOE["raw"]):
        rate = run["rate"].replace("tbf ", "")
        for mode in S.MODES:
            rows = {r["method"]: r for r in run["rows"] if r["mode"] == mode}
            out[f"moe|{run['world']}|{rate}|{mode}"] = {
                m: {"median": rows[m]["block"], "samples": rows[m]["samples"]} for m in S.MOE["methods"]}
    return out


def _topology(root: str) -> dict:
    out = {}
    for table in _load(root, S.TOPOLOGY["raw"])["tables"]:
        for row in table["rows"]:
            out[f"topology|{table['world_size']}|{row['bytes']}"] = {
                m: {"median": row[f"{m}_us"] * 1e-6, "samples": None} for m in S.TOPOLOGY["methods"]}
    return out


def measured(root: str) -> dict:
    return {**_overlap(root), **_moe(root), **_topology(root)}


def _pairs(point: str, methods) -> list[tuple[str, str]]:
    """(base, other) pairs whose winner is checked at this point."""
    if point.startswith("topology"):
        return [("stock", m) for m in methods if m != "stock"]
    if "stock" not in methods:
        return [("flash", "flash c=2"), ("flash", "flash c=4")]
    return [("stock", "flash")] + [(m, "flash") for m in methods if m.startswith("slicing")]


def winners(pred: dict, meas: dict) -> list[dict]:
    out = []
    for point, ms in meas.items():
        p = pred[point]
        for base, other in _pairs(point, list(ms)):
            b, o = ms[base], ms[other]
            if b["samples"] is not None:
                s = speedup(b["samples"], o["samples"])
                verdict = "faster" if s["win"] else ("slower" if s["loss"] else "tie")
                ci = s["ci"]
            else:
                verdict = "faster" if o["median"] < b["median"] else "slower"
                ci = None
            predicted = "faster" if p[other] < p[base] else "slower"
            out.append({"point": point, "pair": f"{other} vs {base}", "measured": verdict, "ci": ci,
                        "predicted": predicted, "agree": None if verdict == "tie" else verdict == predicted,
                        "medians_only": b["samples"] is None})
    return out


def errors(pred: dict, meas: dict) -> list[dict]:
    rows = []
    for point, ms in meas.items():
        for m, v in ms.items():
            p = pred[point][m]
            rows.append({"point": point, "method": m, "predicted": p, "measured": v["median"],
                         "error": p / v["median"] - 1.0})
    return rows


def _base(methods) -> str:
    return "stock" if "stock" in methods else "flash"


def ratio_errors(pred: dict, meas: dict) -> list[dict]:
    """Per point and method other than the point's base (stock; flash where only flash rows count): the error of
    the predicted time ratio method / base against the measured one (the tables' own result form: the machine's
    overall speed cancels)."""
    rows = []
    for point, ms in meas.items():
        base = _base(ms)
        for m, v in ms.items():
            if m == base:
                continue
            p = pred[point][m] / pred[point][base]
            q = v["median"] / ms[base]["median"]
            rows.append({"point": point, "method": f"{m} / {base}", "predicted": p, "measured": q,
                         "error": p / q - 1.0})
    return rows


def summary(rows: list[dict], prefix: str = "") -> dict:
    errs = [abs(r["error"]) for r in rows if r["point"].startswith(prefix)]
    if not errs:
        return {"n": 0}
    return {"n": len(errs), "median_abs": statistics.median(errs), "max_abs": max(errs),
            "within_25": sum(e <= 0.25 for e in errs)}
