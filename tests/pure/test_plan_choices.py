"""The probe's pure part: figures -> hardware -> the layers' choices -> the config (plan/probe_plan.py), with given
figures (the GPU part that measures them is tests/gpu/test_probe_gpu.py).

Tier: pure (no processes; seconds). Expected values are worked out from the figures the tests write.
"""
import pytest

from megatron_flashoverlap import config as C
from megatron_flashoverlap.plan import catalog
from megatron_flashoverlap.plan.probe_plan import (Choices, apply, choose, gpu_key, hardware, hardware_json, partners,
                                                probe_shapes)
from megatron_flashoverlap.plan.hardware import load_hardware
from megatron_flashoverlap.plan.model import Layout, Model

ALPHA, RATE = 20e-6, 100e9  # the probed hop: 20 us + bytes / 100 GB/s
MODEL = Model(hidden=1024, ffn=4096, heads=16, layers=2, seq=2048)


def _figures(alpha=ALPHA, rate=RATE, device="NVIDIA H100 80GB HBM3", tp=2):
    layout = Layout(tp=tp, dp=8 // tp)
    gemm = [[m, k, n, 2.0 * m * k * n / 500e12 + 5e-6] for m, k, n in probe_shapes(MODEL, layout)]
    hops = [[b, alpha + b / rate] for b in (1 << 16, 1 << 20, 1 << 24)]
    return {"device": device, "dtype": "bf16", "gpus_per_node": 8, "nodes": 1, "gemm": gemm, "intra": hops,
            "inter": []}


def test_hardware_fits_the_probed_hop_and_keeps_the_catalogue_elsewhere():
    gpu, intra, inter = hardware(_figures())
    nvl = catalog.LINKS["nvlink4"]
    assert gpu.peak_tflops == catalog.GPUS["h100"].peak_tflops
    assert intra.p2p_us == pytest.approx(20.0, rel=1e-6)
    # a hop's effective rate is gbps * p2p_efficiency: the raw rate is 100 GB/s / 0.80
    assert intra.gbps == pytest.approx(100.0 / nvl.p2p_efficiency, rel=1e-6)
    assert intra.coll_efficiency == nvl.coll_efficiency and intra.base_lat_us == nvl.base_lat_us
    assert inter == catalog.LINKS[catalog.DEFAULT_INTER]  # no inter-node figures: the catalogue's


def test_an_unknown_device_takes_its_fastest_probed_gemm_as_peak():
    f = _figures(device="Some Accelerator")
    gpu, _, _ = hardware(f)
    best = max(2.0 * m * k * n / s for m, k, n, s in f["gemm"]) / 1e12
    assert gpu.peak("bf16") == pytest.approx(best * 1e12) and best < 500.0  # the 5 us per GEMM costs some rate


def test_device_names():
    assert gpu_key("NVIDIA H100 80GB HBM3") == "h100" and gpu_key("NVIDIA H200") == "h200"
    assert gpu_key("NVIDIA A100-SXM4-80GB") == "a100" and gpu_key("Tesla T4") is None


def test_hardware_json_loads_back_as_a_hardware_file(tmp_path):
    import json
    path = tmp_path / "probe.json"
    path.write_text(json.dumps(hardware_json(_figures())))
    gpus, links = load_hardware(path, dict(catalog.GPUS), dict(catalog.LINKS))
    assert links["probed-intra"].p2p_us == pytest.approx(20.0, rel=1e-6) and "probed-h100" in gpus


def test_bad_figures_are_refused_with_what_is_missing():
    with pytest.raises(ValueError, match="lack"):
        hardware({"device": "x"})
    f = _figures()
    f["gemm"] = [[1, 2, 3, 0.0]]
    with pytest.raises(ValueError, match="seconds > 0"):
        hardware(f)


def test_choices_are_valid_plans_and_deterministic():
    a = choose(_figures(), MODEL, Layout(tp=2, dp=4, sequence_parallel=True))
    b = choose(_figures(), MODEL, Layout(tp=2, dp=4, sequence_parallel=True))
    assert a.sites == b.sites and a.dp_fuse == b.dp_fuse and a.decode_table == b.decode_table
    assert set(a.sites) == {"qkv", "proj", "fc1", "fc2"}
    for knobs in a.sites.values():
        C.OpPlan(**{k: v for k, v in knobs.items()}, keep_gathered=False)  # every choice is a valid plan
    assert sorted(t["dtype"] for t in a.decode_table["tables"]) == ["bfloat16", "float16"]
    table = a.decode_table["tables"][0]
    assert (table["world_size"], table["local_world_size"], table["backend"]) == (2, 2, "nccl")
    assert [r["bytes"] for r in table["rows"]] == [8192 * 2 ** i for i in range(11)]
    assert "prediction" in a.log


def test_tp1_has_nothing_to_overlap():
    c = choose(_figures(tp=1), MODEL, Layout(tp=1, dp=8, sequence_parallel=False))
    assert {k["algo"] for k in c.sites.values()} == {"reference"} and c.decode_table is None


def test_a_slower_link_never_predicts_a_faster_step():
    layout = Layout(tp=2, dp=4, sequence_parallel=True)
    fast = choose(_figures(), MODEL, layout).predicted
    slow = choose(_figures(alpha=ALPHA * 10, rate=RATE / 100), MODEL, layout).predicted
    assert slow["stock_s"] > fast["stock_s"] and slow["ours_s"] > fast["ours_s"]


def _choices():
    sites = {n: {"algo": "slicing", "num_chunks": 4, "hop_chunks": None} for n in ("qkv", "proj")}
    sites.update({n: {"algo": "flash", "num_chunks": None, "hop_chunks": 2} for n in ("fc1", "fc2")})
    return Choices(sites, 4, "all", {"tables": []})


def test_apply_fills_only_what_the_yaml_left_open():
    cfg = C.from_dict({"fc2": {"algo": "reference"}, "fc1": {"algo": "flash"}, "dp": {"fuse": "none"}})
    out = apply(_choices(), cfg)
    assert out.fc2 == C.OpPlan("reference")  # named: kept
    assert out.fc1 == C.OpPlan("flash", hop_chunks=2)  # named flash, hop_chunks left open: filled
    # unnamed: auto, measured on the real group; the planner's pick is the chooser's model tier (test_chooser)
    assert out.qkv == C.OpPlan("auto") and out.proj == C.OpPlan("auto")
    assert out.dp.fuse == "none"  # the YAML said so
    assert out.all_reduce.num_chunks == 4


def test_apply_keeps_a_default_entry_and_fills_dp_auto():
    cfg = C.from_dict({"default": {"algo": "flash", "hop_chunks": 1}})
    out = apply(_choices(), cfg)
    assert all(out.plan(n) == C.OpPlan("flash", hop_chunks=1) for n in C.LAYERS)  # default names them all
    assert out.dp.fuse == "all"  # auto: the planner's


def test_planner_probe_setting():
    assert C.from_dict({}).planner.probe == "auto"
    assert C.from_dict({"planner": {"probe": "off"}}).planner.probe == "off"
    with pytest.raises(ValueError, match="planner.probe"):
        C.from_dict({"planner": {"probe": "sometimes"}})


def test_probe_shapes_are_the_sites_per_rank():
    shapes = probe_shapes(MODEL, Layout(tp=2, dp=4))
    # fc1 per rank: x [2048, 1024] @ W [1024, 4096 / 2]; and its 1/P row slice; its dgrad and wgrad
    assert {(2048, 1024, 2048), (1024, 1024, 2048), (2048, 2048, 1024), (1024, 2048, 2048)} <= set(shapes)


@pytest.mark.parametrize("world,g,expect", [
    (8, 8, {0: (1, None), 1: (0, None), 6: (7, None)}),
    (16, 8, {0: (1, 8), 9: (8, 1), 15: (14, 7)}),
    (24, 8, {17: (16, None), 3: (2, 11)}),  # the third node has no pair
    (4, 1, {0: (None, 1), 1: (None, 0), 2: (None, 3)}),
])
def test_partners_pair_symmetrically(world, g, expect):
    for rank, want in expect.items():
        assert partners(rank, world, g) == want
    for r in range(world):
        for p in partners(r, world, g):
            if p is not None:
                assert r in partners(p, world, g)


def test_the_predicted_decode_table_is_read_by_the_all_reduce_selector():
    from megatron_flashoverlap.ops.all_reduce.select import best_at

    table = choose(_figures(), MODEL, Layout(tp=2, dp=4, sequence_parallel=True)).decode_table["tables"][0]
    for row in table["rows"]:
        ours = {a: row[f"{a}_us"] for a in ("ring", "recursive_doubling", "hierarchical")}
        fastest = min(ours, key=ours.get)
        want = fastest if ours[fastest] < row["reference_us"] else None
        assert best_at(table, row["bytes"]) == want
