"""Tier 3 (Megatron on gloo): our linears beside Megatron's stock ones, and the spec/CPU-shim plumbing.

Bodies in tests/megatron/mp_megatron_layers.py. Tolerances: forward outputs and input grads exact at P=2 (each
output element is the same dot product, and a 2-term sum does not depend on order); weight grads 1e-5
relative (summed slice by slice in fp32).
"""
import pytest

CONTRACT = "tests.megatron.mp_megatron_layers:contract"


@pytest.mark.parametrize("kind, sp, skip_bias_add, site", [
    ("column", True, False, "qkv"), ("column", True, True, "fc1"), ("row", True, True, "proj"),
    ("row", True, False, "fc2"), ("column", False, True, "fc1"), ("row", False, True, "fc2"),
    ("column", True, False, None)])
def test_layer_is_a_drop_in(pools, kind, sp, skip_bias_add, site):
    for res in pools(2).run(CONTRACT, kind, sp, skip_bias_add, site, timeout=300):
        assert res["params"] and res["values"], "same parameter names/shapes/TP attributes and init"
        assert res["attrs"], "every attribute of the stock layer, with the same value"
        assert res["accepts"] and res["sharded"]
        assert res["backward_dw"] == (None, None)  # ours has it in every version (0.16 stock row lacks it)
        assert res["shapes"][0] == res["shapes"][1]
        assert res["bias_is_param"] == (skip_bias_add, skip_bias_add)  # (output, bias) contract
        assert res["y_err"] == 0.0 and res["dx_err"] == 0.0
        assert res["grad_rel"] <= 1e-5


def test_gradient_accumulation_fusion_is_refused(pools):
    msg = pools(2).run("tests.megatron.mp_megatron_layers:grad_accum_fusion_refused", timeout=300)[0]
    assert msg and "gradient_accumulation_fusion=False" in msg


def test_spec_reads_config_from_env_and_rejects_bad_files(pools, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("qkv_fprop: {algo: warp}\n")
    from_env, default, err = pools(2).run("tests.megatron.mp_megatron_layers:spec_config_sources", str(bad), timeout=300)[0]
    assert (from_env, default) == ("slicing", "flash")
    assert err and "unknown algo 'warp'" in err and "bad.yaml" in err


def test_spec_refuses_moe_and_mla(pools):
    moe, mla = pools(2).run("tests.megatron.mp_megatron_layers:spec_refusals", timeout=300)[0]
    assert "MoE" in moe and "multi-latent" in mla


def test_cpu_enable_is_idempotent_and_patches_only_on_cpu(pools):
    assert pools(2).run("tests.megatron.mp_megatron_layers:cpu_shims", timeout=300)[0] == (
        True, True, True, False, "cpu", "cpu")
