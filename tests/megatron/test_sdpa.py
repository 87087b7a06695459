"""Tier 3 (Megatron on gloo): SdpaDotProductAttention (megatron/sdpa.py) vs Megatron's DotProductAttention,
at TP=2 (each rank its heads), forward and backward. Bodies in tests/megatron/mp_sdpa.py.

Tolerances (fp32): 1e-5 of max |reference| for y, dq, dk, dv: the same softmax(scale q k^T + mask) v, but
SDPA's kernel and baddbmm + softmax + bmm order the fp32 sums differently (measured: 6e-8 to 4e-7).
bf16 / fp16: one epsilon of the type times max |y| (DotProductAttention rounds scores and probabilities to it,
SDPA accumulates in fp32: measured 0.25-0.75 eps), and SDPA no farther than DotProductAttention from fp64.
Dropout: the masks are SDPA's own, so it is tested by statistics (5 sigma of a binomial) and repeats.
CPU fallback: a kernel with no CPU implementation runs the math kernel: exactly ours with kernels=("math",).
"""
import pytest

from megatron_flashoverlap.megatron import sdpa

BODY = "tests.megatron.mp_sdpa:versus_dpa"
TOL = 1e-5


def _check(results, shape=(16, 2, 2 * 8)):
    for r in results:
        assert r["shape"] == list(shape) and r["finite"]
        assert max(r["rel"]) <= TOL, dict(zip(("y", "dq", "dk", "dv"), r["rel"]))


@pytest.mark.parametrize("mask,mask_type", [(None, "causal"), ("causal", "causal"), ("padding", "padding"),
                                            ("causal_left_pad", "causal"), (None, "no_mask")],
                         ids=["default_causal", "causal_mask", "padding", "fully_masked_rows", "no_mask"])
def test_masks_match_dot_product_attention(pools, mask, mask_type):
    _check(pools(2).run(BODY, mask=mask, mask_type=mask_type, timeout=300))


@pytest.mark.parametrize("mask", [None, "padding"], ids=["flash_path", "masked_path"])
def test_gqa_matches(pools, mask):  # 4 heads over 2 query groups: 1 group per rank at TP=2
    _check(pools(2).run(BODY, mask=mask, mask_type="causal" if mask is None else "padding", groups=2,
                        timeout=300))


def test_softmax_scale_layer_scaling_and_training_at_p0(pools):
    _check(pools(2).run(BODY, softmax_scale=0.3, train=True, timeout=300))  # dropout p = 0 in training mode
    _check(pools(2).run(BODY, layer_scaling=True, timeout=300))


@pytest.mark.parametrize("kernels", [("math",), ("flash",)])
def test_restricted_kernels_match(pools, kernels):  # what --attention-backend unfused / flash select
    _check(pools(2).run(BODY, kernels=kernels, timeout=300))


def test_dropout_keep_probability_and_determinism(pools):
    p = 0.3
    for r in pools(2).run("tests.megatron.mp_sdpa:dropout_stats", p=p, timeout=300):
        for name in ("dpa", "ours"):  # DotProductAttention first: the probe itself must read p back
            s = r[name]
            sigma = (p * (1 - p) / s["n"]) ** 0.5
            assert abs(s["zero_fraction"] - p) <= 5 * sigma, (name, s)
            # every kept prob is 1/sk scaled by 1/(1 - p): one value (fp32: a few ulp)
            assert s["kept_min"] == pytest.approx(1 / (64 * (1 - p)), rel=1e-6), (name, s)
            assert s["kept_max"] == pytest.approx(1 / (64 * (1 - p)), rel=1e-6), (name, s)
            assert s["same_seed_equal"] and s["other_seed_differs"], (name, s)


@pytest.mark.parametrize("dtype, mask", [("bfloat16", "causal"), ("bfloat16", "padding"), ("float16", "padding")])
def test_half_precision_within_one_epsilon_and_closer_to_fp64(pools, dtype, mask):
    for r in pools(2).run("tests.megatron.mp_sdpa:half_precision_error", dtype=dtype, mask=mask, timeout=300):
        assert r["between"] <= r["eps"], r  # one rounding of the scores and one of the probabilities apart
        assert r["ours"] <= r["dpa"], r  # the fp32 accumulation is the closer to fp64


def test_unsupported_inputs_raise_value_errors(pools):
    for r in pools(2).run("tests.megatron.mp_sdpa:unsupported", timeout=300):
        assert "attention bias" in r["bias"] and "packed" in r["packed"]
        assert "must be bool" in r["float_mask"]
        assert "sq == sk" in r["causal_sq_ne_sk"]
        for choice in ("--attention-backend auto", "unfused", "attention.core megatron"):
            assert choice in r["no_kernel_on_cuda"], r["no_kernel_on_cuda"]  # on CUDA: an error naming them


@pytest.mark.parametrize("kernels, dropout", [(("efficient", "cudnn"), 0.0), (("efficient",), 0.0),
                                              (("flash",), 0.2)],
                         ids=["fused", "efficient", "flash_with_dropout"])
def test_cpu_runs_math_where_the_kernel_is_missing_with_one_log_line(pools, kernels, dropout):
    """Llama 3's --attention-backend fused on CPU (issue 26 item 1): no 'No viable backend' error; the math
    kernel runs (equal to the bit to ours with kernels=("math",), dropout masks included), said once."""
    for r in pools(2).run("tests.megatron.mp_sdpa:cpu_fallback", kernels=kernels, dropout=dropout, timeout=300):
        assert r["equal"] == [True, True, True] and r["ran"] == [], r  # math: no fused SDPA op ran
        assert len(r["logged"]) == 1 and "math kernel runs" in r["logged"][0], r["logged"]
        assert str(kernels) in r["logged"][0]


def test_cpu_honours_a_kernel_it_has(pools):
    """--attention-backend flash without dropout: CPU has a flash kernel, so it runs, and nothing is logged."""
    for r in pools(2).run("tests.megatron.mp_sdpa:cpu_fallback", kernels=("flash",), timeout=300):
        flash = "_scaled_dot_product_flash_attention_for_cpu"
        assert r["ran"] == [flash, flash + "_backward"] and r["logged"] == [], r


def test_sdpa_config_refusal_at_build():
    from megatron_flashoverlap.megatron import models as tm

    with pytest.raises(ValueError, match="Ulysses"):
        sdpa.SdpaDotProductAttention(tm.tiny_config(1, False, context_parallel_size=2), 1, None, "self")


@pytest.mark.parametrize("config_kw, why", [({"softmax_type": "learnable"}, "--softmax-type learnable"),
                                            ({"softmax_type": "off-by-one"}, "--softmax-type off-by-one"),
                                            ({"window_size": (4, 0)}, "--window-size 4,0 (sliding-window")])
def test_what_sdpa_does_not_implement_builds_megatrons_attention(pools, config_kw, why):
    for r in pools(2).run("tests.megatron.mp_sdpa:falls_back_to_megatron", **config_kw, timeout=300):
        assert r["classes"] == ["DotProductAttention", "DotProductAttention"]
        assert len(r["logged"]) == 1 and why in r["logged"][0] and "DotProductAttention runs" in r["logged"][0]
