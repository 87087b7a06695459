"""Tier 3 (Megatron on gloo): SdpaDotProductAttention (megatron/sdpa.py) vs Megatron's DotProductAttention,
at TP=2 (each rank its heads), forward and backward. Bodies in tests/megatron/mp_sdpa.py.

Tolerances (fp32): 1e-5 of max |reference| for y, dq, dk, dv: the same softmax(scale q k^T + mask) v, but
SDPA's kernel and baddbmm + softmax + bmm order the fp32 sums differently (measured: 6e-8 to 4e-7).
Dropout: the masks are SDPA's own, so it is tested by statistics (5 sigma of a binomial) and repeats.
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


def test_unsupported_inputs_raise_value_errors(pools):
    for r in pools(2).run("tests.megatron.mp_sdpa:unsupported", timeout=300):
        assert "attention bias" in r["bias"] and "packed" in r["packed"]
        assert "must be bool" in r["float_mask"]
        assert "sq == sk" in r["causal_sq_ne_sk"]
        assert "--attention-backend auto" in r["fused_kernel_on_cpu"]


def test_unsupported_config_raises_at_build():
    from megatron_flashoverlap.megatron import models as tm

    for kw, text in ((dict(softmax_type="learnable"), "softmax_type"), (dict(window_size=(4, 0)), "sliding"),
                     (dict(context_parallel_size=2), "Ulysses")):
        cfg = tm.tiny_config(1, False, **kw)
        with pytest.raises(ValueError, match=text):
            sdpa.core_attention_for(cfg, "auto")
        with pytest.raises(ValueError, match=text):
            sdpa.SdpaDotProductAttention(cfg, 1, None, "self")


def test_core_attention_for_maps_the_backend_names():
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnBackend

    assert sdpa.core_attention_for(None, "local") is DotProductAttention
    assert sdpa.core_attention_for(None, AttnBackend.auto) is sdpa.SdpaDotProductAttention
    for name, kernels in (("flash", ("flash",)), ("fused", ("efficient", "cudnn")), ("unfused", ("math",))):
        spec = sdpa.core_attention_for(None, getattr(AttnBackend, name))
        assert spec.module is sdpa.SdpaDotProductAttention and spec.params == {"kernels": kernels}
    with pytest.raises(ValueError, match="unknown attention backend"):
        sdpa.core_attention_for(None, "fastest")


def test_spec_default_path_selects_sdpa_and_stock_config_keeps_megatron():
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megatron_flashoverlap.config import uniform
    from megatron_flashoverlap.megatron.spec import layer_spec, submodules_of

    def core(spec):
        return submodules_of(spec.submodules.self_attention).core_attention

    assert core(layer_spec()) is sdpa.SdpaDotProductAttention
    assert core(layer_spec(uniform("reference"))) is DotProductAttention  # the stock local layer, exactly


def test_spec_honours_megatrons_attention_backend():
    """--attention-backend reaches the spec through Megatron's model config (config.attention_backend)."""
    from types import SimpleNamespace

    from megatron.core.transformer.enums import AttnBackend

    from megatron_flashoverlap.megatron.spec import _layer_for, submodules_of

    def core(backend):
        return submodules_of(_layer_for(SimpleNamespace(attention_backend=backend)).submodules.self_attention
                             ).core_attention

    assert core(AttnBackend.auto) is sdpa.SdpaDotProductAttention
    assert core(None) is sdpa.SdpaDotProductAttention  # a config without the field: Megatron's default, auto
    for name, kernels in (("flash", ("flash",)), ("fused", ("efficient", "cudnn")), ("unfused", ("math",))):
        spec = core(getattr(AttnBackend, name))
        assert spec.module is sdpa.SdpaDotProductAttention and spec.params == {"kernels": kernels}
