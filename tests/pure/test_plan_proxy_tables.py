"""The planner's CPU-proxy validation (benchmarks/planner): every committed table point is predicted, the
predictions never read a measured time, and the committed comparison is what today's code makes from the
committed calibration.

Tier: pure (reads files; the planner runs in-process on the committed calibration, nothing is measured).
"""
import ast
import json
import pathlib

import pytest

from benchmarks.planner import compare as C
from benchmarks.planner.predict import predict_all
from benchmarks.planner.table import render

ROOT = pathlib.Path(__file__).resolve().parents[2]
DATA = ROOT / "benchmarks" / "planner" / "data"


RUNS = ("", "_2", "_3")  # the three committed calibrations: data/calibration{,_2,_3}.json


@pytest.fixture(scope="module", params=RUNS, ids=["first", "second", "third"])
def predictions(request):
    cal = json.loads((DATA / f"calibration{request.param}.json").read_text())
    return request.param, cal, {stat: predict_all(cal, stat) for stat in ("lo", "median")}


def _flat(pred: dict) -> dict:
    return {k: v for section in pred.values() for k, v in section.items()}


def test_every_committed_point_is_predicted(predictions):
    _, _, preds = predictions
    meas = C.measured(str(ROOT / "benchmarks"))
    pred = _flat(preds["lo"])
    assert set(pred) == set(meas)
    assert all(set(pred[k]) == set(meas[k]) for k in meas)


def test_predict_reads_no_file_and_no_comparison():
    """predict.py may not open a file or import what reads the tables (compare.py): it sees settings only."""
    tree = ast.parse((ROOT / "benchmarks" / "planner" / "predict.py").read_text())
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    mods = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names} | {
        n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert "open" not in names and "json" not in mods and not any("compare" in (m or "") for m in mods)


@pytest.mark.newest_only  # the numbers do not depend on the Megatron version: one lane checks them
def test_committed_comparison_is_what_the_calibration_gives(predictions):
    run, cal, preds = predictions
    committed = json.loads((DATA / f"predictions{run}.json").read_text())
    assert json.loads(json.dumps(preds)) == committed
    named = {{"lo": "minimum"}.get(s, s): _flat(p) for s, p in preds.items()}
    text = render(named, C.measured(str(ROOT / "benchmarks")), cal, f"calibration{run}.json")
    assert text == (DATA / f"comparison{run}.md").read_text(), (
        f"python benchmarks/planner/run.py --predict --compare --calibration "
        f"benchmarks/planner/data/calibration{run}.json")
