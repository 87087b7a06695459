"""Benchmark harness tests. Tiers: pure (rates, gpu_check import), namespaces (root only), the launcher
(`run_ranks`: torchrun ranks, results, failures, timeout), and a 2-rank gloo smoke run of the harness on tiny
sizes (no timing assertions). The cost model and the timing loop: tests/pure/test_costmodel.py."""
import importlib.util
import json
import math
import os
import re
import subprocess

import pytest
import torch

from benchmarks.overlap import table as report
from benchmarks.harness.blocks import METHODS, operator_methods
from benchmarks.gpu_check.check import _sites
from benchmarks.harness.netns import Namespace, parse_bytes, parse_rate, shaped_namespace, why_not_shaped

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_parse_rate():
    assert parse_rate("1gbit") == 1e9
    assert parse_rate("250mbit") == 250e6
    assert parse_rate("12kbit") == 12e3
    with pytest.raises(ValueError, match="e.g. '1gbit'"):
        parse_rate("fast")


def test_parse_bytes_and_burst_floor():
    assert parse_bytes("512kb") == 512 * 1024 and parse_bytes("2mb") == 2 * 1024 ** 2 and parse_bytes("100") == 100
    with pytest.raises(ValueError, match="e.g. '512kb'"):
        parse_bytes("lots")
    with pytest.raises(ValueError, match="MTU"):
        Namespace("never-created").shape_lo("1gbit", burst="64kb")  # refused before any tc call


def _ns_list():
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


@pytest.mark.skipif(why_not_shaped() is not None, reason="needs root + iproute2 (namespaces and tc)")
def test_namespace_shaped_then_deleted_even_on_error():
    with pytest.raises(RuntimeError, match="boom"):
        with shaped_namespace("1gbit", burst="256kb") as ns:
            name = ns.name
            assert "tbf" in ns.qdisc() and "rate 1Gbit" in ns.qdisc()
            assert "127.0.0.1" in ns.run(["ip", "-br", "addr"], capture_output=True, text=True).stdout
            raise RuntimeError("boom")
    assert name not in _ns_list()


def _load_script(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "benchmarks", name, "run.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_gpu_check_sites_are_megatrons_gemm_shapes():
    """(K, N, reduce-scatter?) of one TP=4 rank's GEMMs at d_model 4096 (the dry run is tests/gloo/test_gpu_check_dry.py)."""
    assert _sites(4096, 4) == {"qkv": (4096, 3072, False), "proj": (1024, 4096, True), "fc1": (4096, 4096, False),
                               "fc2": (4096, 4096, True)}


def test_overlap_cli_quick_defaults():
    a = _load_script("overlap").parse(["--quick", "--unshaped"])
    assert a.unshaped and a.repeats == 1 and a.rate_sweep == ""


def test_blocks_agree_across_methods(pools):
    """Every method's block is the same math: outputs and grads match stock (fp32 sums reordered: close)."""
    res = pools(2).run("tests.gloo.mp_bench:block_outputs", "mlp", (16, 2, 8, 12, 4), timeout=120)
    res += pools(2).run("tests.gloo.mp_bench:block_outputs", "attn", (16, 2, 8, 12, 4), timeout=120)
    for per_method in res:
        ref = per_method["stock"]
        for name, got in per_method.items():
            for a, b in zip(got, ref):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)


def test_harness_smoke_writes_table_plot_trace(pools, tmp_path):
    cfg = {"kinds": ["mlp", "attn"], "seqs": [16, 32], "batch": 1, "hidden": 8, "width": 16, "head_dim": 4,
           "repeats": 1, "methods": [m.name for m in operator_methods(METHODS)], "label": "smoke",
           "trace": {"kind": "mlp", "seq": 16, "methods": ["stock", "slicing k=2", "flash"]},
           "megatron": {"seq": 16, "methods": [m.name for m in METHODS]}}  # the layers' auto: Megatron rows only
    out = pools(2).run("tests.gloo.mp_bench:harness", cfg, timeout=600)[0]  # generous: the CI box is shared
    out["rate"] = "unshaped (test)"
    ops = len(METHODS) - 1
    assert len(out["rows"]) == 2 * 2 * ops * 2  # kinds x seqs x operator methods x modes
    for r in out["rows"]:
        assert r["block"] > 0 and r["compute"] > 0 and r["comm"] > 0 and math.isfinite(r["hidden"])
    assert len(out["megatron_rows"]) == 2 * (1 + len(METHODS))  # (Megatron stock + ours per method) x modes
    picked = {r["picked"] for r in out["megatron_rows"] if r["method"] == "ours: auto"}
    assert len(picked) == 1 and re.fullmatch(r"fc1=(stock|flash), fc2=(stock|flash)", picked.pop())
    assert "megatron stock" in report.megatron_table(out) and "ours: auto (ran fc1=" in report.megatron_table(out)
    md = report.table(out)
    assert md.count("\n") == 1 + len(out["rows"]) and "flash_bidir" in md
    assert len(report.verdict(out, "mlp", "fwd")) == 2
    report.plot([out], str(tmp_path / "seq.png"))
    report.trace(out["traces"], str(tmp_path / "trace.json"))
    assert (tmp_path / "seq.png").stat().st_size > 0
    ev = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    for key in ("stock|fwd", "slicing k=2|fwd+bwd", "flash|fwd", "flash|fwd+bwd"):
        pid = next(e["pid"] for e in ev if e["ph"] == "M" and e["args"]["name"] == key)
        for rank in (0, 1):
            assert any(e["ph"] == "X" and e["pid"] == pid and e["tid"] == 10 * rank + 1 for e in ev), key  # slices
            assert any(e["ph"] == "X" and e["pid"] == pid and e["tid"] == 10 * rank + 2 for e in ev), key  # comm
    report.timeline_png(out["traces"], str(tmp_path / "timeline.png"))
    assert (tmp_path / "timeline.png").stat().st_size > 0


def test_run_ranks_function_target_gets_args_env_and_a_group():
    from benchmarks.harness.launch import run_ranks

    res = run_ranks("tests.gloo.mp_bench:ranks_echo", 2, args=({"k": [1, 2]},), env={"BENCH_TEST_COMMON": "c"},
                    rank_env=lambda r: {"BENCH_TEST_TAG": f"t{r}"}, timeout=300)
    assert [r["rank"] for r in res] == [0, 1] and all(r["world"] == 2 for r in res)
    assert all(r["payload"] == {"k": [1, 2]} and r["common"] == "c" for r in res)
    assert [r["tag"] for r in res] == ["t0", "t1"] and all(r["sum"] == 3.0 for r in res)  # 1 + 2, exact


def test_run_ranks_module_target_and_save_result():
    from benchmarks.harness.launch import run_ranks

    res = run_ranks(["tests.gloo.mp_bench", "--flag", 7], 2, timeout=300)
    assert res == [{"argv": ["--flag", "7"], "rank": 0}, None]  # rank 1 saved nothing


def test_run_ranks_failing_rank_raises_and_stops_the_others():
    from benchmarks.harness.launch import run_ranks

    with pytest.raises(RuntimeError, match="ranks_fail on 2 ranks failed"):
        run_ranks("tests.gloo.mp_bench:ranks_fail", 2, timeout=300)  # rank 0 sits in a barrier: no hang


def test_run_ranks_rank_killed_by_a_signal_prints_every_threads_stack(capfd):
    from benchmarks.harness.launch import run_ranks

    with pytest.raises(RuntimeError, match="ranks_abort on 2 ranks failed"):
        run_ranks("tests.gloo.mp_bench:ranks_abort", 2, timeout=300)
    err = capfd.readouterr().err
    assert "Fatal Python error: Aborted" in err  # faulthandler, before the process died
    assert "_parked_beside_the_abort" in err  # the other thread's stack too, not only the aborting one


def test_run_ranks_timeout_kills_every_rank(tmp_path):
    from benchmarks.harness.launch import run_ranks

    with pytest.raises(TimeoutError, match="larger timeout"):
        # 12 s: about twice a 2-rank start-up here (the other run_ranks tests: 6 s each, start to end)
        run_ranks("tests.gloo.mp_bench:ranks_sleep", 2, args=(str(tmp_path),), timeout=12)
    pids = [int(p.read_text()) for p in sorted(tmp_path.glob("*.pid"))]
    assert len(pids) == 2  # both ranks were up before the timeout
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
