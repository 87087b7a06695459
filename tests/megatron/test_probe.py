"""The start-up probe (megatron/probe.py) on gloo: the code a GPU run takes at model build, timed on the host
clock here (`planner: {probe: always}`), so CI executes it. Its GPU timer and bf16 GEMMs: tests/gpu/test_probe_gpu.py;
its figures through the pure planner: tests/pure/test_plan_choices.py; inside Megatron's pretrain(): test_pretrain.py.

Tier 3 (gloo pool, both lanes)."""
from __future__ import annotations

HOPS = (1 << 16, 1 << 20, 1 << 24)


def test_the_probe_measures_on_gloo_and_every_rank_gets_the_same_figures(pools):
    out = pools(2).run("tests.megatron.mp_probe:figures", timeout=300)
    (fig0, shapes, chose), (fig1, _, _) = out
    assert fig0 == fig1  # each figure the max over the group: every rank plans from the same numbers
    assert fig0["backend"] == "gloo" and fig0["dtype"] == "fp32" and fig0["device"] == "host CPU (gloo)"
    assert [r[:3] for r in fig0["gemm"]] == shapes and all(r[3] > 0 for r in fig0["gemm"])
    assert [b for b, _ in fig0["intra"]] == list(HOPS) and all(s > 0 for _, s in fig0["intra"])
    assert fig0["inter"] == []  # one node: no inter-node partner
    small, big = chose["work"]
    assert big[3] > 10 * small[3], (big, small)  # the clock measures work, not a constant
    assert fig0["intra"][-1][1] > fig0["intra"][0][1]  # 16 MiB takes longer than 64 KiB
    assert chose["sites"] == ["fc1", "fc2", "proj", "qkv"]
    assert chose["table"]["backend"] == "gloo" and chose["table"]["world_size"] == 2  # the model tier's key
