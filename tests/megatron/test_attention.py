"""Query-split attention: numerics on 2-4 gloo CPU processes, against Megatron's DotProductAttention.

Tier: numerics (gloo processes). Worker bodies in tests/megatron/mp_attention.py. Pure checks (errors)
run in-process; the cost model (benchmarks/overlap/costmodel.py) is tested in tests/pure/test_costmodel.py.
"""
import pytest
import torch

from megatron_flashoverlap.ops.attention.core import Attend, AttnSpec, attention_rows, zigzag_positions
from megatron_flashoverlap.ops.attention.query_split import query_split_attention

BODY = "tests.megatron.mp_attention:"


def _check(res, tol):
    for r in res:
        assert r["dtype_ok"]
        for n in ("y", "dq", "dk", "dv", "dw"):
            scale = max(r[n + "_scale"] if n != "y" else r["y_scale"], 1.0)
            assert r[n] <= tol * scale, (n, r[n], scale, r)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_query_split_matches_megatron_fp32(pools, world):
    # fp32: the RS sums the P partials in ring order and block GEMMs round differently: close, not exact
    _check(pools(world).run(BODY + "vs_megatron", "float32", timeout=300), 2e-5)


@pytest.mark.parametrize("algo", ["flash_bidir", "slicing", "reference"])
def test_query_split_other_algos_match_megatron(pools, algo):
    # same inputs and tolerance as above; slicing = attention, then the GEMM+RS cut in 2 chunks
    res = pools(2).run(BODY + "vs_megatron", "float32", algo=algo, num_chunks=2 if algo == "slicing" else None,
                       timeout=300)
    _check(res, 2e-5)


def test_query_split_padding_and_gqa(pools):
    # padding mask OR-ed with causal in ours; Megatron gets the combined mask; 12 heads over 4 kv groups
    _check(pools(2).run(BODY + "vs_megatron", "float32", groups=4, padding=True, timeout=300), 2e-5)


def test_query_split_bf16(pools):
    # bf16: ours keeps fp32 partial sums across ranks, Megatron rounds each partial to bf16 before its RS:
    # a few bf16 ulps of the output scale
    _check(pools(2).run(BODY + "vs_megatron", "bfloat16", timeout=300), 3e-2)


@pytest.mark.parametrize("dtype,softmax_in_fp32", [("float32", True), ("bfloat16", True), ("bfloat16", False)])
@pytest.mark.parametrize("dropout", [0.0, 0.25])
def test_core_attention_is_dot_product_attentions_arithmetic(pools, dtype, softmax_in_fp32, dropout):
    # the whole sequence runs DotProductAttention's torch calls in its order (the softmax's precision by
    # --attention-softmax-in-fp32, stock's dropout draw): bitwise on any BLAS; blocks of rows run smaller GEMMs
    # (a BLAS may sum those in another order): within fp32 roundoff, or one bf16 rounding, of the output scale
    for r in pools(2).run(BODY + "core_vs_dot_product", dtype, softmax_in_fp32, dropout, timeout=300):
        assert r["ctx_equal"] and r["grads_equal"] and r["next_equal"], r
        assert r["blocks"] <= (1e-6 if dtype == "float32" else 2 ** -7) * max(r["scale"], 1.0), r
        assert (r["kept"] < 0.9) == (dropout > 0), r  # a mask was drawn: 1 - p of 4096 probabilities kept


def test_dropout_is_split_independent(pools):
    res = pools(2).run(BODY + "dropout_vs_reference", timeout=300)
    for r in res:
        assert r["y"] <= 1e-5 and r["grads"] <= 1e-5, r  # same per-row masks; only the RS sum order differs
        assert r["changed"] > 1e-3, r  # dropout did something


def test_dropout_rows_do_not_depend_on_the_split():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(8, 1, 2, 4, generator=g) for _ in range(3))
    spec = AttnSpec(scale=0.5, causal=True, dropout_p=0.5, seed=5)
    full = attention_rows(q, k, v, spec, 0)
    parts = torch.cat([attention_rows(q[a:b], k, v, spec, a) for a, b in ((0, 3), (3, 6), (6, 8))])
    assert torch.equal(full, parts)  # no sum is reordered: exact


def test_zigzag_positions():
    assert zigzag_positions(8, 2).tolist() == [0, 1, 6, 7, 2, 3, 4, 5]
    with pytest.raises(ValueError, match="2 \\* context_parallel_size"):
        zigzag_positions(6, 2)


def test_errors_name_the_fix():
    q = torch.randn(4, 1, 3, 2)
    kv = torch.randn(4, 1, 2, 2)
    with pytest.raises(ValueError, match="num_query_groups"):
        query_split_attention(q, kv, kv, torch.randn(5, 6))
    with pytest.raises(ValueError, match="bool"):
        query_split_attention(q, q, q, torch.randn(5, 6), attend=Attend(mask=torch.zeros(1, 1, 4, 4)))
    with pytest.raises(ValueError, match="dropout_p"):
        query_split_attention(q, q, q, torch.randn(5, 6), attend=Attend(dropout_p=1.0))


@pytest.mark.parametrize("world,dropout", [(2, 0.0), (4, 0.0), (2, 0.3), (4, 0.3)])
def test_query_split_zigzag_matches_dense(pools, world, dropout):
    # fp32 vs a float64 dense formula: rounding of fp32 GEMMs and the ring-order sum, close; with dropout the
    # drawn mask (attend.keep) must follow the rows' zigzag order
    for r in pools(world).run(BODY + "zigzag_vs_dense", dropout=dropout, timeout=300):
        for n in ("y", "dq", "dk", "dv", "dw"):
            assert r[n] <= 1e-5 * max(r["scale"], 1.0), (n, r)


@pytest.mark.parametrize("world,algo,groups,dropout", [(2, "flash", 8, 0.0), (4, "flash", 8, 0.25),
                                                        (2, "flash_bidir", 8, 0.0), (2, "flash", 2, 0.0)])
def test_backward_runs_through_the_kept_graphs(pools, world, algo, groups, dropout):
    # the forward computes each block's attention once, under autograd, and the backward recomputes none of it
    # (a block it did not keep would be recomputed: 0 means every ring span of the backward met a kept one);
    # a forward without grad keeps nothing. Against the recompute path (a forward that kept nothing): the same
    # ops on the same inputs in the same order, so equal to the bit
    for r in pools(world).run(BODY + "kept_vs_recompute", algo=algo, groups=groups, dropout=dropout, timeout=300):
        assert r["forward"] >= world and r["backward"] == 0 and r["no_grad_kept"] == 0, r
        assert r["y"] == 0.0 and r["exact"], r
