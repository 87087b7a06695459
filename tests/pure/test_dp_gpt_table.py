"""Tier: pure. The GPT DDP table of benchmarks/dp/run.py (benchmarks/dp/table.py) on hand-made samples."""
import pytest

from benchmarks.dp import table as t
from benchmarks.dp.gpt import check_arms

# exact comparisons: medians of integer-valued lists and their differences are exact in binary floating point


def _arm(step, free, buckets=1, fused=0, bwd=None):
    arm = {"step": step, "free": free, "tail": [s - f for s, f in zip(step, free)], "buckets": [1] * buckets,
           "fused": ["w"] * fused}
    return arm if bwd is None else {**arm, "bwd": bwd}


def _run():
    return {"comm": [10.0, 10.0, 10.0], "arms": {
        "stock": _arm([20.0, 21.0, 22.0], [10.0, 10.0, 10.0]),  # exposed 11
        "stock, small buckets": _arm([15.0, 16.0, 17.0], [10.0, 10.0, 10.0], buckets=5),  # exposed 6
        "ours, fusion off": _arm([19.0, 20.0, 21.0], [9.0, 9.0, 9.0]),
        "ours, auto": _arm([11.0, 12.0, 12.0], [10.0, 10.0, 10.0], fused=8),  # exposed 2: 2/11 of stock's
        "ours, auto, small buckets": _arm([17.0, 18.0, 19.0], [10.0, 10.0, 10.0], buckets=6, fused=1),
        "ours, auto, ring in bwd": _arm([21.0, 21.0, 21.0], [10.0, 10.0, 10.0], fused=8)}}


def test_rows_hold_exposed_hidden_and_ratios_against_the_same_bucket_stock():
    rows = {r["arm"]: r for r in t.rows(_run())}
    auto, small = rows["ours, auto"], rows["ours, auto, small buckets"]
    assert (auto["exposed"], auto["hidden"], auto["exposed_ratio"]["ratio"]) == (2.0, 0.8, 2.0 / 11.0)
    assert auto["vs_ref"]["ratio"] == 21.0 / 12.0 and auto["best"] == "stock, small buckets"
    assert small["exposed_ratio"]["ratio"] == 8.0 / 6.0 and small["vs_ref"]["ratio"] == 16.0 / 18.0


def test_verdict_calls_the_targets():
    lines = t.verdict(_run(), "1gbit, TP2xDP2")
    assert len(lines) == 3
    assert "no slower" in lines[0] and "target <= 0.20: met" in lines[0]
    assert "SLOWER" in lines[1] and "MISSED" in lines[1]
    assert "MISSED" in lines[2]  # exposed 11 = stock's


def test_the_link_bound_is_comm_alone_minus_the_arms_backward_and_named_where_the_target_is_below_it():
    run = _run()  # comm alone 10; stock exposes 11, so the target allows 2.2
    run["arms"]["ours, auto, ring in bwd"]["bwd"] = [3.0, 4.0, 5.0]  # bound 10 - 4 = 6 > 2.2: unreachable
    run["arms"]["ours, auto, small buckets"]["bwd"] = [9.0, 9.0, 9.0]  # bound 1 <= 2.2: a plain miss
    run["arms"]["ours, auto"]["bwd"] = [12.0, 12.0, 12.0]  # backward longer than the comm: bound 0
    rows = {r["arm"]: r for r in t.rows(run)}
    assert (rows["ours, auto, ring in bwd"]["bound"], rows["ours, auto, small buckets"]["bound"],
            rows["ours, auto"]["bound"], rows["stock"]["bound"]) == (6.0, 1.0, 0.0, None)
    lines = {ln.split(":")[0]: ln for ln in t.verdict(run, "x")}
    assert lines["- x, ours, auto, ring in bwd"].endswith(
        "MISSED, below the link bound: the target allows 2200 ms, no schedule exposes less than 6000 ms "
        "(comm alone - backward))")
    assert lines["- x, ours, auto, small buckets"].endswith("MISSED)")
    table = t.table(run).splitlines()
    assert table[0].endswith("| link bound ms |")
    assert [ln.rsplit("|", 2)[1].strip() for ln in table[2:]] == ["-", "-", "-", "0", "1000", "6000"]


def test_the_host_floor_is_the_reductions_cpu_time_over_the_cores_where_the_ranks_fill_them():
    run = {**_run(), "comm_cpu": [5.0, 6.0, 9.0], "cores": 2, "world": 4}
    assert t.host_floor(run) == 3.0  # median 6 over 2 cores
    assert t.host_floor({**run, "world": 1}) is None  # a core left idle: the reduction may run there
    assert t.host_floor(_run()) is None  # recorded before the CPU time was sampled
    lines = {ln.split(":")[0]: ln for ln in t.verdict(run, "x")}  # small-bucket stock exposes 6: allows 1.2
    assert lines["- x, ours, auto, small buckets"].endswith(
        "MISSED, below the host floor: the target allows 1200 ms, the reduction's own CPU time on these cores "
        "is about 3000 ms)")


def test_table_has_a_row_per_arm():
    assert len(t.table(_run()).splitlines()) == 2 + 6


def test_a_reference_exposing_nothing_in_some_resamples_leaves_the_ratio_undefined():
    # stock, small buckets: exposed 0, 1, -1 over its rounds (median 0 in some resamples): no ratio, no "met"
    run = _run()
    run["arms"]["stock, small buckets"] = _arm([10.0, 11.0, 9.0], [10.0, 10.0, 10.0], buckets=5)
    small = [ln for ln in t.verdict(run, "x") if "ours, auto, small buckets" in ln][0]
    assert "undefined" in small and ": met" not in small, small
    row = {r["arm"]: r for r in t.rows(run)}["ours, auto, small buckets"]["exposed_ratio"]
    assert row["ci"][1] == float("inf")  # resamples where stock exposes nothing: no finite upper end


def test_render_rebuilds_the_tables_from_the_raw_samples(tmp_path):
    """benchmarks/dp/run.py --render RAW: dp.md beside RAW rewritten from its samples, title and command kept."""
    import importlib.util
    import json
    import os

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    spec = importlib.util.spec_from_file_location("dp_bench", os.path.join(root, "benchmarks", "dp", "run.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    run = {**_run(), "config": {"tp": 2, "layers": 4, "hidden": 512, "heads": 8, "seq": 512, "batch": 1,
                                "vocab": 1024, "bucket": 3, "repeats": 3},
           "world": 4, "dp": 2, "log": ["flash DP overlap (automatic, cost model): x"], "rate": "1gbit",
           "loadavg": [1.0, 2.0]}
    (tmp_path / "dp_raw.json").write_text(json.dumps([run]))
    (tmp_path / "dp.md").write_text("# title\n\nCommand: `python benchmarks/dp/run.py --x`\n\n## Verdict\n\nold\n")
    assert mod.main(["--render", str(tmp_path / "dp_raw.json")]) == 0
    md = (tmp_path / "dp.md").read_text()
    assert md.startswith("# title\n\nCommand: `python benchmarks/dp/run.py --x`\n") and "old" not in md
    assert "1gbit, TP2xDP2, ours, auto:" in md and "target <= 0.20: met" in md and md.count("| ours, auto |") == 1
    assert mod.main(["--render", str(tmp_path / "dp_raw.json")]) == 0  # again: one note, not two
    again = (tmp_path / "dp.md").read_text()
    assert again.count(mod.RENDERED) == 1 and "\n\n\n" not in again


def test_an_unshaped_run_recorded_before_topology_is_labelled_host_loopback():
    """A run's header names its link; runs from before --topology recorded none: an unshaped one ran on the host
    loopback, not on the shared tbf link."""
    from benchmarks.dp import run as mod

    run = {**_run(), "config": {"tp": 1, "layers": 4, "hidden": 512, "heads": 8, "seq": 512, "batch": 1,
                                "vocab": 1024, "bucket": 3, "repeats": 3},
           "world": 2, "dp": 2, "log": [], "rate": "unshaped (host loopback)"}
    head = [ln for ln in mod.body([run]).splitlines() if ln.startswith("## link")][0]
    assert head.endswith("; host loopback") and "tbf" not in head
    shared = [ln for ln in mod.body([{**run, "rate": "1gbit"}]).splitlines() if ln.startswith("## link")][0]
    assert shared.endswith("; " + mod.TOPOLOGY["shared"])


def test_a_subset_of_arms_is_judged_against_stock_alone():
    run = _run()
    run["arms"] = {k: run["arms"][k] for k in ("stock", "ours, auto")}
    rows = {r["arm"]: r for r in t.rows(run)}
    assert rows["ours, auto"]["best"] == "stock" and rows["ours, auto"]["vs_best"]["ratio"] == 21.0 / 12.0


def test_check_arms_needs_the_stock_arm_of_the_same_buckets_and_keeps_arms_order():
    assert check_arms(["ours, auto", "stock"]) == ("stock", "ours, auto")
    for bad, word in ((["ours, auto"], "add ['stock']"), (["stock", "ours, auto, small buckets"],
                      "add ['stock, small buckets']"), (["stock", "ours"], "not arms")):
        with pytest.raises(ValueError, match=word.replace("[", r"\[").replace("]", r"\]")):
            check_arms(bad)
