"""The planner's one-window validation (benchmarks/planner --one-window): the scoring, that a prediction never sees
a measured sample, and that the committed window's tables are what today's code makes from its raw data.

Tier: pure (reads files; the planner prices the committed calibrations in-process, nothing is measured). Expected
values in the scoring tests are worked out in the comments from the samples they give.
"""
import ast
import json
import pathlib

import pytest

from benchmarks.planner import score as C
from benchmarks.planner.window_table import render

ROOT = pathlib.Path(__file__).resolve().parents[2]
DATA = ROOT / "benchmarks" / "planner" / "data"

STOCK = [1.0, 1.0, 1.0, 1.0, 1.2]  # median 1.0, spread (1.2 - 1.0) / 1.0 = 20 %
WINDOW = {"name": "w", "world": 2, "points": [{"kind": "mlp", "seq": 8, "samples": {
    "stock": {"fwd": STOCK},
    "flash": {"fwd": [0.5, 0.5, 0.5, 0.5, 0.6]},  # median 0.5: 2x faster in every round
    "twin": {"fwd": [1.2, 1.0, 1.0, 1.0, 1.0]}}}]}  # stock's rounds reordered: ratio 1.0, a measured tie
PRED = [[{"before": {"stock": {"fwd": 1.05}, "flash": {"fwd": 0.4}, "twin": {"fwd": 0.9}},
          "after": {"stock": {"fwd": 1.155}, "flash": {"fwd": 0.4}, "twin": {"fwd": 0.9}}}]]


def test_errors_are_predicted_over_measured_median_with_drift_and_spread():
    rows = {r["method"]: r for r in C.errors([WINDOW], PRED, "before")}
    assert rows["stock"]["error"] == pytest.approx(0.05)  # 1.05 / 1.0 - 1
    assert rows["flash"]["error"] == pytest.approx(-0.2)  # 0.4 / 0.5 - 1
    assert rows["stock"]["drift"] == pytest.approx(0.1)  # after 1.155 / before 1.05 - 1
    assert rows["stock"]["spread"] == pytest.approx(0.2)
    assert rows["stock"]["point"] == "w / mlp s=8 #1"
    after = {r["method"]: r for r in C.errors([WINDOW], PRED, "after")}
    assert after["stock"]["error"] == pytest.approx(0.155)
    bracket = {r["method"]: r for r in C.errors([WINDOW], PRED)}  # the default: (1.05 + 1.155) / 2 = 1.1025
    assert bracket["stock"]["error"] == pytest.approx(0.1025) and bracket["stock"]["before"] == 1.05


def test_checks_score_every_pair_and_leave_measured_ties_unscored():
    checks = {c["pair"]: c for c in C.checks([WINDOW], PRED)}
    assert set(checks) == {"flash vs stock", "twin vs stock", "twin vs flash"}
    assert checks["flash vs stock"]["measured"] == "flash faster" and checks["flash vs stock"]["agree"] is True
    assert checks["twin vs stock"]["measured"] == "tie" and checks["twin vs stock"]["agree"] is None
    # twin (measured 1.0) is slower than flash (0.5) beyond doubt; predicted 0.9 vs 0.4: flash faster
    assert checks["twin vs flash"]["measured"] == "flash faster" and checks["twin vs flash"]["agree"] is True
    wrong = [[{**PRED[0][0], "before": {"stock": {"fwd": 0.3}, "flash": {"fwd": 0.4}, "twin": {"fwd": 0.9}}}]]
    assert {c["pair"]: c["agree"] for c in C.checks([WINDOW], wrong, "before")}["flash vs stock"] is False


def test_summary_and_targets():
    s = C.summary(C.errors([WINDOW], PRED, "before"), C.checks([WINDOW], PRED, "before"))
    # |errors|: stock 0.05, flash 0.2, twin |0.9 / 1.0 - 1| = 0.1 -> median 0.1, max 0.2, all within 25 %
    assert s["n"] == 3 and s["median_abs"] == pytest.approx(0.1) and s["max_abs"] == pytest.approx(0.2)
    assert (s["within_25"], s["agree"], s["disagree"], s["ties"]) == (3, 2, 0, 1)
    assert C.met(s) == {"median_abs": True, "max_abs": True, "winners": True}
    assert C.met({**s, "median_abs": 0.11, "max_abs": 0.26, "agree": 19, "disagree": 2}) == {
        "median_abs": False, "max_abs": False, "winners": False}  # 19 / 21 = 90.5 % < 95 %


def test_window_predictions_never_read_a_measured_sample():
    """window_predict.py prices a point from its settings and a calibration: it never names the samples, opens a
    file or imports the scoring."""
    src = (ROOT / "benchmarks" / "planner" / "window_predict.py").read_text()
    tree = ast.parse(src)
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    mods = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert "samples" not in src and "open" not in names
    assert not any(m and ("score" in m or "compare" in m) for m in mods)


@pytest.mark.newest_only  # the numbers do not depend on the Megatron version: one lane checks them
@pytest.mark.parametrize("name", ["window", "window_2", "window_3", "window_4", "window_5", "window_6", "window_7",
                                  "window_8", "window_9"])
def test_committed_window_is_what_its_raw_data_gives(name):
    raw = json.loads((DATA / f"{name}.json").read_text())
    assert render(raw, f"{name}.json") == (DATA / f"{name}.md").read_text(), (
        f"python benchmarks/planner/run.py --one-window --compare --window benchmarks/planner/data/{name}.json")
