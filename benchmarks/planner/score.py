"""The one-window scores: each point's predicted time against its measured median, and the predicted winner of
every pair of methods against the measured one where the measured interval excludes a tie.

    errors(points, preds, which="bracket") -> rows {"window", "point", "mode", "method", "predicted", "measured",
                                                   "error", "before", "after", "drift", "spread"}
        error   predicted / measured median - 1; the prediction `which`: "bracket" (the primary: the mean of the
                predictions from the calibration just before the point and the one just after it, which bracket
                the machine's state while the point ran), "before" or "after" alone
        drift   the prediction from the calibration after the point / the one before - 1: how far the machine
                moved across the point (noise, not the model)
        spread  (max - min) / min of the point's rounds
    checks(points, preds, which="bracket", measured=None) -> per (point, mode) and pair of methods (a listed
        before b): the measured verdict from harness/estimator.speedup(samples a, samples b) ("b faster": its
        90 % interval lies above 1.0, "a faster": below, else "tie"; `verdicts(points)`, made once for every
        prediction), the predicted one, agree (None for a measured tie)
    summary(rows, checks) -> {"n", "median_abs", "max_abs", "within_25", "agree", "disagree", "ties"}
    TARGETS: the issue's: median abs error <= 10 %, none beyond 25 %, the winner right at >= 95 % of the
        pairs that are not a measured tie; met(summary) -> {target: bool}
"""
from __future__ import annotations

import itertools
import statistics

from benchmarks.harness.estimator import speedup

TARGETS = {"median_abs": 0.10, "max_abs": 0.25, "winners": 0.95}


def point_label(win: dict, pt: dict, i: int) -> str:
    """'tbf 1gbit / mlp s=1024 #1': the window, the point's kind and size, its pass."""
    size = {"mlp": "s={seq}", "mlp_nosp": "s={seq}", "moe": "tokens={tokens}", "all_reduce": "P={world}"}
    return f"{win['name']} / {pt['kind']} {size[pt['kind']].format(world=win['world'], **pt)} #{i}"


def _runs(windows: list, preds: list):
    """(window, point, label, prediction) over every point of every window, in run order; the label counts the
    point's passes."""
    for win, wpred in zip(windows, preds):
        seen: dict = {}
        for pt, pr in zip(win["points"], wpred):
            key = (pt["kind"], pt.get("seq"), pt.get("tokens"))
            seen[key] = seen.get(key, 0) + 1
            yield win, pt, point_label(win, pt, seen[key]), pr


def prediction(pr: dict, which: str) -> dict:
    """{method: {mode: seconds}} of one point: the calibration `which`, or "bracket": the mean of before and after."""
    if which != "bracket":
        return pr[which]
    b, a = pr["before"], pr["after"]
    return {m: {mode: (b[m][mode] + a[m][mode]) / 2 for mode in b[m]} for m in b}


def errors(windows: list, preds: list, which: str = "bracket") -> list[dict]:
    rows = []
    for win, pt, label, pr in _runs(windows, preds):
        mine = prediction(pr, which)
        for m, modes in pt["samples"].items():
            for mode, s in modes.items():
                med, p = statistics.median(s), mine[m][mode]
                before, after = pr["before"][m][mode], pr["after"][m][mode]
                rows.append({"window": win["name"], "point": label, "mode": mode, "method": m, "predicted": p,
                             "measured": med, "error": p / med - 1.0, "before": before, "after": after,
                             "drift": after / before - 1.0,
                             "spread": (max(s) - min(s)) / min(s)})
    return rows


def verdicts(windows: list) -> list[dict]:
    """Per (point, mode) and pair of methods (a listed before b), in checks' order: the measured speedup of b over a
    (harness/estimator.speedup) and its verdict; what `checks` scores, measured once for every prediction."""
    out = []
    for win, pt, label, _ in _runs(windows, [[None] * len(w["points"]) for w in windows]):
        methods = list(pt["samples"])
        for mode in pt["samples"][methods[0]]:
            for a, b in itertools.combinations(methods, 2):
                s = speedup(pt["samples"][a][mode], pt["samples"][b][mode])
                measured = f"{b} faster" if s["win"] else (f"{a} faster" if s["loss"] else "tie")
                out.append({"window": win["name"], "point": label, "mode": mode, "pair": (a, b), "ratio": s["ratio"],
                            "ci": s["ci"], "measured": measured})
    return out


def checks(windows: list, preds: list, which: str = "bracket", measured: list | None = None) -> list[dict]:
    """The winner checks (module docstring); measured: `verdicts(windows)`, when already made."""
    measured = verdicts(windows) if measured is None else measured
    mine = {label: prediction(pr, which) for _, _, label, pr in _runs(windows, preds)}
    out = []
    for v in measured:
        (a, b), p, mode = v["pair"], mine[v["point"]], v["mode"]
        predicted = f"{b} faster" if p[b][mode] < p[a][mode] else f"{a} faster"
        out.append({**v, "pair": f"{b} vs {a}", "predicted": predicted,
                    "agree": None if v["measured"] == "tie" else v["measured"] == predicted})
    return out


def summary(rows: list[dict], checks_: list[dict]) -> dict:
    errs = [abs(r["error"]) for r in rows]
    scored = [c for c in checks_ if c["agree"] is not None]
    agree = sum(c["agree"] for c in scored)
    return {"n": len(errs), "median_abs": statistics.median(errs) if errs else float("nan"),
            "max_abs": max(errs, default=float("nan")), "within_25": sum(e <= 0.25 for e in errs),
            "agree": agree, "disagree": len(scored) - agree, "ties": len(checks_) - len(scored)}


def met(s: dict) -> dict:
    scored = s["agree"] + s["disagree"]
    return {"median_abs": s["median_abs"] <= TARGETS["median_abs"], "max_abs": s["max_abs"] <= TARGETS["max_abs"],
            "winners": scored > 0 and s["agree"] / scored >= TARGETS["winners"]}
