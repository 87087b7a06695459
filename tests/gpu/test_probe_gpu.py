"""Tier 4 (CUDA only): the start-up probe's GPU part (megatron/probe.py measure) on one process, and its
figures through the planner's pure part (plan/probe_plan.py; tested with given figures in
tests/pure/test_plan_choices.py).

One rank: a NCCL group of one, so the GEMMs are timed and no hop has a partner (both hop lists stay empty:
the planner then keeps the catalogue's links).
"""

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def one_rank_nccl(tmp_path_factory):
    import torch.distributed as dist
    store = tmp_path_factory.mktemp("pg") / "store"
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_probe_figures_and_choices(one_rank_nccl):
    from megatron_flashoverlap.megatron.probe import measure
    from megatron_flashoverlap.plan.probe_plan import choose, hardware, probe_shapes
    from megatron_flashoverlap.plan.model import Layout, Model

    model, layout = Model(hidden=4096, ffn=16384, heads=32, layers=2, seq=4096), Layout(tp=8, dp=1)
    shapes = probe_shapes(model, layout)
    figures = measure(shapes, gpus_per_node=1)
    assert [tuple(r[:3]) for r in figures["gemm"]] == [tuple(s) for s in shapes]
    assert all(r[3] > 0 for r in figures["gemm"]) and figures["intra"] == [] and figures["inter"] == []
    big = max(figures["gemm"], key=lambda r: r[0] * r[1] * r[2])
    tflops = 2.0 * big[0] * big[1] * big[2] / big[3] / 1e12
    assert 1.0 < tflops < 5000.0, tflops  # a bf16 GEMM of this size runs at TFLOP/s, not GFLOP/s or beyond peak
    gpu, _, _ = hardware(figures)
    figures8 = dict(figures, gpus_per_node=8)  # price the TP = 8 layout from this GPU's GEMMs
    c = choose(figures8, model, layout)
    assert set(c.sites) == {"qkv", "proj", "fc1", "fc2"} and gpu.name.startswith("probed")
