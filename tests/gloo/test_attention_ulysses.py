"""Ulysses core attention (op level) on 2 and 4 gloo CPU processes vs full attention in one process (plain torch
softmax attention in float64, independent of the operator's kernel: a defect in that kernel shows here).

Tier: numerics (gloo processes). Worker bodies in tests/gloo/mp_attention_ulysses.py. The Megatron GPTModel
tests (CP=2, TP=2 x CP=2 vs no CP) live in tests/megatron/test_attention_gpt.py.
"""
import pytest

BODY = "tests.gloo.mp_attention_ulysses:vs_full"
# against plain softmax attention in float64 (mp_attention_ulysses.full_attention, not the operator's kernel) on
# the same dtype-rounded inputs; relative to max(|ref|, 1):
# fp32: the operator's fp32 GEMMs and softmax round at 2^-24 per operation, over sums of s = 16 keys and
#       hn = 4 products: 2e-6 (measured <= 3.3e-7)
# bf16: scores, probs and ctx are rounded to bf16 (2^-8 = 3.9e-3): 5 bf16 ulps, 2e-2 (measured <= 6.3e-3)
TOL = {"float32": 2e-6, "bfloat16": 2e-2}


def _check(res, dtype="float32"):
    for r in res:
        assert r["dtype_ok"]
        for n in ("y", "dq", "dk", "dv"):
            assert r[n] <= TOL[dtype] * max(r["scale"], 1.0), (n, r)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("algo", ["flash", "reference"])
def test_ulysses_zigzag_causal_matches_full_attention(pools, world, algo):
    _check(pools(world).run(BODY, algo=algo, timeout=300))


@pytest.mark.parametrize("zigzag", [True, False])
def test_ulysses_padding_mask_rows_gathered(pools, zigzag):
    # the mask arrives as Megatron slices it (this rank's rows, keys in sequence order)
    _check(pools(2).run(BODY, zigzag=zigzag, padding=True, timeout=300))


def test_ulysses_gqa_and_bf16(pools):
    _check(pools(2).run(BODY, groups=2, timeout=300))
    _check(pools(2).run(BODY, dtype="bfloat16", timeout=300), "bfloat16")


def test_ulysses_wrong_order_is_caught(pools):
    # zigzag shards treated as contiguous: the causal mask is wrong, so this must NOT match
    res = pools(2).run(BODY, op_zigzag=False, timeout=300)
    assert max(r["y"] for r in res) > 1e-2


def test_ulysses_heads_not_divisible():
    from megatron_flashoverlap.ops.attention.ulysses import check_ulysses_heads

    with pytest.raises(ValueError, match="tensor_model_parallel_size x context_parallel_size = 4"):
        check_ulysses_heads("x", 3, 3, 2, tp=2)  # 6 heads over TP=2 -> 3 per rank


FUSED = "tests.gloo.mp_attention_ulysses:fused_vs_reference"


@pytest.mark.parametrize("world,kw", [(2, {}), (2, {"bias": False, "groups": 4}), (4, {"heads": 8, "groups": 4})])
def test_ulysses_fused_projections_match_unfused(pools, world, kw):
    # the fused op sums the proj over head groups in consume order (fp32-close to one GEMM over all heads); y_vs_full
    # against the float64 formula (projections + full_attention): measured <= 2e-7 relative
    for r in pools(world).run(FUSED, timeout=300, **kw):
        assert r["dtype_ok"]
        assert r["y_vs_stock"] <= 2e-6 * r["scale"] and r["y_vs_full"] <= 2e-6 * r["scale"], r
        assert r["grads_vs_stock"] <= 2e-6 * r["gscale"], r


def test_ulysses_fused_bf16(pools):
    # bf16: fused keeps fp32 partial sums over head groups, the stock path rounds its single GEMM: ulps
    for r in pools(2).run(FUSED, dtype="bfloat16", heads=8, groups=4, timeout=300):
        assert r["y_vs_stock"] <= 1e-2 * r["scale"] and r["grads_vs_stock"] <= 1e-2 * r["gscale"], r


def test_ulysses_fused_bad_weight_layout():
    import torch

    from megatron_flashoverlap.ops.attention.core import Attend
    from megatron_flashoverlap.ops.attention.ulysses_fused import ulysses_fused_attention

    with pytest.raises(ValueError, match="linear_qkv layout"):
        ulysses_fused_attention(torch.randn(4, 1, 8), torch.randn(10, 8), torch.randn(8, 8), attend=Attend(heads=2))
