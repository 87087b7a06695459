"""benchmarks/moe/run.py: the three measures route alike (2 gloo ranks), and the unshaped quick run writes its table
and raw JSON (torchrun ranks, seconds; no timing assertions). Newest lane only: megatron-core 0.16.1's MoE router
needs Transformer Engine (tests/megatron/test_moe_gpt.py). The table logic: tests/pure/test_moe_table.py."""
import importlib.util
import json
import math
import os

import pytest
import torch

from benchmarks.moe.rows import MODES, methods

pytestmark = pytest.mark.newest_only
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_compute_and_comm_alone_keep_the_routes(pools):
    """compute alone (exchange on the fake group) and comm alone (expert ffn 1) see the block's split sizes, the
    real EP group comes back after the fake call, and every method's block computes the same layer."""
    for res in pools(2).run("tests.megatron.mp_moe_bench:measures_route_alike", timeout=600):
        ref = res["stock"]
        for m, r in res.items():
            assert r["compute"] == r["block"] == r["comm"] == ref["block"], (m, r["block"], r["compute"], r["comm"])
            assert r["restored"], f"{m}: the dispatcher's ep_group must be the real group after a compute-alone call"
            # same seed, same weights, the exchange moves rows exactly: equal but for a BLAS kernel picked
            # for another row count (an algo running experts per source block): 1e-6
            torch.testing.assert_close(r["y"], ref["y"], rtol=1e-6, atol=1e-6, msg=m)
            torch.testing.assert_close(r["dx"], ref["dx"], rtol=1e-6, atol=1e-6, msg=m)


def _script():
    spec = importlib.util.spec_from_file_location("moe_bench", os.path.join(ROOT, "benchmarks", "moe", "run.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_unshaped_quick_run_writes_table_and_raw(tmp_path):
    assert _script().main(["--unshaped", "--quick", "--out", str(tmp_path)]) == 0
    md, raw = (tmp_path / "moe.md").read_text(), json.loads((tmp_path / "moe_raw.json").read_text())
    assert [run["world"] for run in raw] == [2] and raw[0]["rate"] == "unshaped (host loopback)"
    rows = raw[0]["rows"]
    assert [(r["method"], r["mode"]) for r in rows] == [(m, mode) for m in methods() for mode in MODES]
    for r in rows:
        assert all(math.isfinite(r[k]) and r[k] > 0 for k in ("block", "compute", "comm")), r
        assert len(r["samples"]) == 2
    assert "EP=2, link unshaped (host loopback)" in md and "stock's comm alone / stock's block" in md
    for m in methods()[1:]:
        assert f"- {m} vs stock:" in md and f"| {m} | fwd+bwd |" in md
