"""The validation table, the hardware data and the planner's imports.

Tier: pure (no processes; seconds). The validation's verdicts are not asserted (they are the model's results,
reported as met or missed); what is asserted is the table's honesty (every row sourced, enough baselines) and
that the command writes one result per row.
"""
import ast
import csv
import json
import pathlib
import sys

import pytest

from megatron_flashoverlap.plan import catalog, published as validate
from megatron_flashoverlap.plan.hardware import Gpu, load_hardware

PLAN = pathlib.Path(validate.__file__).parent
ROWS = list(csv.DictReader(open(validate.TABLE, newline="")))
KINDS = {"op", "collective", "gemm_collective", "e2e", "reconstructed", "unscored"}


def test_every_row_is_sourced_and_well_formed():
    assert len({r["id"] for r in ROWS}) == len(ROWS)
    for r in ROWS:
        assert r["kind"] in KINDS and r["expect"] in {"gain", "no_gain", "baseline"}, r["id"]
        assert "http" in r["source"] or "arXiv" in r["source"], r["id"]  # a URL or a paper for every row
        assert float(r["baseline"]) > 0, r["id"]
        if r["kind"] not in ("unscored",):
            assert r["gpu"] in catalog.GPUS and r["intra"] in catalog.LINKS and r["inter"] in catalog.LINKS


def test_enough_published_baselines_and_no_gain_cases():
    scored = [r for r in ROWS if r["kind"] in ("op", "collective", "gemm_collective", "e2e")]
    assert len(scored) >= 10  # the issue's target is judged on >= 10 rows
    assert sum(r["expect"] == "no_gain" for r in ROWS) >= 1 and sum(r["structure"] == "ours" for r in ROWS) >= 3
    assert all("RECONSTRUCTED" in r["note"] for r in ROWS if r["kind"] == "reconstructed")


def test_the_rows_hold_nccls_all_reduce_on_one_nvlink_node_and_a_pcie_node():
    """NCCL's all-reduce at 64 KiB-16 MiB on one NVLink node (the decode all-reduce's regime) and PCIe-only rows."""
    ar = [int(r["bytes"]) for r in ROWS if r["op"] == "all_reduce" and r["kind"] == "collective"
          and r["nodes"] == "1" and r["intra"].startswith("nvlink")]
    assert min(ar) <= 64 * 2 ** 10 and max(ar) >= 16 * 2 ** 20
    assert any(r["intra"].startswith("pcie") and r["kind"] == "op" for r in ROWS)
    assert {r["level"] for r in ROWS} <= {"", "call", "kernel"}


def test_the_command_writes_one_result_per_row(tmp_path, capsys):
    out = tmp_path / "results.csv"
    assert validate.main(["--out", str(out)]) == 0
    results = list(csv.DictReader(open(out, newline="")))
    assert [r["id"] for r in results] == [r["id"] for r in ROWS]
    text = capsys.readouterr().out
    assert "baseline within 15 %" in text and "no-gain cases" in text and "misses:" in text


def test_user_hardware_file(tmp_path):
    f = tmp_path / "hw.json"
    f.write_text(json.dumps({"gpus": {"mygpu": {"peak_tflops": {"bf16": 500.0}, "hbm_gbps": 2000.0, "sms": 100,
                                                "gemm_efficiency": 0.7}}}))
    gpus, links = load_hardware(f, catalog.GPUS, catalog.LINKS)
    assert gpus["mygpu"].peak("bf16") == 500e12 and links == catalog.LINKS and "h100" in gpus
    f.write_text(json.dumps({"gpus": {"x": {"peak": 1}}}))
    with pytest.raises(ValueError, match="unknown field"):
        load_hardware(f, catalog.GPUS, catalog.LINKS)
    with pytest.raises(ValueError, match="fractions"):
        Gpu("bad", {"bf16": 1.0}, 1.0, 1, gemm_efficiency=1.5)


def test_the_catalogue_has_the_issues_hardware():
    assert {"h100", "h200", "b200", "a100", "h800"} <= set(catalog.GPUS)
    assert {"nvlink3", "nvlink4", "nvlink5", "ib_ndr", "ib_xdr", "slingshot11"} <= set(catalog.LINKS)
    assert all(catalog.GPU_INTRA[g] in catalog.LINKS for g in catalog.GPUS)


def test_the_planner_imports_only_stdlib_schedules_and_config():
    """plan/ is pure: the standard library, megatron_flashoverlap.{plan,schedules,config}; matplotlib only
    inside the timeline's function (an optional import)."""
    allowed = ("megatron_flashoverlap.plan", "megatron_flashoverlap.schedules", "megatron_flashoverlap.config")
    bad = []
    for path in sorted(PLAN.rglob("*.py")):
        tree = ast.parse(path.read_text())
        top_level = {id(n) for n in tree.body}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level:
                continue  # relative: inside the package, checked by test_layering's floors
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                root = name.split(".")[0]
                if root in sys.stdlib_module_names or name.startswith(allowed):
                    continue
                if root == "matplotlib" and id(node) not in top_level and path.name == "timeline.py":
                    continue
                bad.append(f"{path.name}: {name}")
    assert not bad, bad
