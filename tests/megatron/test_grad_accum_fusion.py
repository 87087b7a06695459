"""Tier 3 (Megatron on 2 gloo ranks): gradient_accumulation_fusion=True (Megatron-LM's default) in our layers.

A TP=2 GPT from our spec (SP on and off) in Megatron's DistributedDataParallel (fp32 grad buffers; the
distributed optimizer's layout with overlap_grad_reduce, and the plain one), 3 micro-batches as Megatron's
schedules run them. Bodies: tests/megatron/mp_gaf.py.
Tolerances (relative to the parameter's max |main_grad|, fp32):
  fusion on vs off    1e-6: the same products; on adds each slice into main_grad, off sums the slices in a
                      zero buffer that DDP then adds (the order of the fp32 adds differs slice by slice).
  ours vs stock       1e-5 (the bar of test_megatron_gpt.py for grads): the ring sums dW and dx slice by
                      slice where stock runs one GEMM / gloo's collective.
"""
import pytest

GRADS = "tests.megatron.mp_gaf:main_grads"


def _check(res, fused=True):
    for worst in res["on_vs_off"]:  # after the first and after the last micro-batch
        assert worst[1] <= 1e-6, f"main_grad of {worst[0]}: fusion on vs off differ by {worst[1]:.2e}"
    for key in ("off_vs_stock", "on_vs_stock"):
        for worst in res[key]:
            assert worst[1] <= 1e-5, f"{key}: main_grad of {worst[0]} differs by {worst[1]:.2e}"
    assert res["nonzero"], "every parameter must get a gradient, or the comparison proves nothing"
    assert res["grads_left"] == (0, 0), "no .grad may be left after DDP's hooks"
    on, off = res["flags"]
    assert len(on) == 8 and all(v is fused for v in on.values()), on  # 4 linears x 2 layers
    assert not any(off.values()), off
    assert res["config_kept"], "Megatron's config object must keep gradient_accumulation_fusion=True"


@pytest.mark.parametrize("dist_opt", [False, True], ids=["ddp", "distopt"])
@pytest.mark.parametrize("sp", [True, False], ids=["sp", "nosp"])
def test_fused_main_grad_matches_unfused_and_stock(pools, sp, dist_opt):
    for res in pools(2).run(GRADS, sp, dist_opt, timeout=300):
        _check(res)
        assert res["log"] == [], "every site runs our operators: no stock forward"


@pytest.mark.parametrize("flash", [{"default": {"algo": "flash_bidir"}},
                                   {"default": {"algo": "slicing", "num_chunks": 2}},
                                   {"default": {"algo": "flash", "keep_gathered": True}}],
                         ids=["flash_bidir", "slicing", "keep_gathered"])
def test_other_algorithms_fuse_too(pools, flash):
    for res in pools(2).run(GRADS, True, False, flash, timeout=300):
        _check(res)


@pytest.mark.parametrize("sp", [True, False], ids=["sp", "nosp"])
def test_reference_sites_run_stock_forward_unfused(pools, sp):
    """algo reference = Megatron's own forward, whose fused path needs apex: without it that forward runs
    with the fusion off (dW to .grad, DDP adds it), logged once per layer kind."""
    res = pools(2).run(GRADS, sp, False, {"default": {"algo": "reference"}}, timeout=300)[0]
    _check(res, fused=False)
    fused_model = [line for line in res["log"] if "apex" in line and "main_grad" in line]
    assert {line.split(":")[0] for line in fused_model} == {"FlashColumnParallelLinear", "FlashRowParallelLinear"}


def test_layers_build_with_fusion_without_apex(pools):
    res = pools(2).run("tests.megatron.mp_gaf:build_with_fusion", timeout=300)[0]
    assert res["config_is_shared"] and res["config_flag"] is True  # Megatron's config left untouched
    assert res["ours"] == (True, True)  # our operators add dW into main_grad
    assert res["stock_forward"] == (False, False)  # no apex here: a stock forward would run unfused


def test_missing_main_grad_names_the_fix(pools):
    msg = pools(2).run("tests.megatron.mp_gaf:no_main_grad", timeout=300)[0]
    assert msg and "DistributedDataParallel" in msg and "--no-gradient-accumulation-fusion" in msg
