"""Tier: numerics on 2 and 4 gloo CPU processes. Tensor parallel without sequence parallel (all-reduce):
`matmul_all_reduce` (row-parallel forward) and `matmul_allreduce_dgrad` (column-parallel backward)
against a float64 dense formula and against the reference (GEMM, then dist.all_reduce)."""
import pytest
import torch

from megatron_flashoverlap.ops.tp_nosp.plain import chunk_rows

FP32 = 1e-4  # fp32, sums reordered (GEMM cut in row slices, ring order of the partial sums): close, not exact
BF16 = 3e-2  # bf16 inputs: GEMMs round to bf16 (8 bits of mantissa); relative to the output scale


def test_chunk_rows_are_whole_rank_blocks():
    assert chunk_rows(12, 2, 2) == [(0, 6), (6, 12)]
    assert chunk_rows(8, 4, 3) == [(0, 4), (4, 8)]  # 2 blocks of 4 rows cannot make 3 chunks: empty dropped
    for s, p, c in [(16, 2, 3), (24, 4, 2), (6, 2, 5)]:
        spans = chunk_rows(s, p, c)
        assert spans[0][0] == 0 and spans[-1][1] == s
        assert all((b - a) % p == 0 and b > a for a, b in spans)


@pytest.mark.parametrize("algo,chunks", [("flash", 1), ("flash", 2), ("flash", 3), ("flash_bidir", 2),
                                         ("slicing", 3), ("reference", None)])
def test_row_all_reduce_matches_dense_and_reference(pools, algo, chunks):
    res = pools(2).run("tests.gloo.mp_tp_nosp:row", algo, 12, 2, 8, 6, num_chunks=chunks)
    for r in res:
        tol = FP32 * max(1.0, r["scale"])
        assert r["y"] < tol and r["y_vs_ref"] < tol and r["dx"] < tol and r["dw"] < tol, r
        assert r["dtype_ok"]
    assert torch.equal(res[0]["y_out"], res[1]["y_out"])  # replicated: every rank holds the same bits


def test_row_all_reduce_bf16(pools):
    res = pools(2).run("tests.gloo.mp_tp_nosp:row", "flash", 8, 2, 16, 8, dtype="bfloat16", num_chunks=2)
    for r in res:
        assert r["y"] < BF16 * max(1.0, r["scale"]) and r["dtype_ok"], r
    assert torch.equal(res[0]["y_out"], res[1]["y_out"])  # fp32 partial sums rounded once, then gathered


@pytest.mark.parametrize("algo", ["flash", "flash_bidir"])
def test_row_all_reduce_four_ranks(pools, algo):
    res = pools(4).run("tests.gloo.mp_tp_nosp:row", algo, 16, 1, 8, 4, num_chunks=2)
    for r in res:
        assert r["y"] < FP32 * max(1.0, r["scale"]) and r["dx"] < FP32 and r["dw"] < FP32, r
    assert all(torch.equal(res[0]["y_out"], r["y_out"]) for r in res)


@pytest.mark.parametrize("algo,chunks,world", [("flash", 2, 2), ("flash", 1, 2), ("flash_bidir", 2, 2),
                                               ("slicing", 2, 2), ("reference", None, 2), ("flash", 2, 4)])
def test_column_dgrad_all_reduce(pools, algo, chunks, world):
    res = pools(world).run("tests.gloo.mp_tp_nosp:column", algo, 8, 2, 6, 8, num_chunks=chunks)
    for r in res:
        tol = FP32 * max(1.0, r["scale"])
        assert r["y"] < tol and r["dx"] < tol and r["dw"] < tol and r["db"] < tol, r
    assert all(torch.equal(res[0]["dx_out"], r["dx_out"]) for r in res)  # replicated input gradient


# a sequence not divisible by P runs decomposed too (zero-padded): tests/gloo/test_tp_nosp_uneven.py


def test_bad_num_chunks_names_the_fix():
    from megatron_flashoverlap.ops import OpPlan
    from megatron_flashoverlap.ops.tp_nosp.autograd import matmul_all_reduce
    with pytest.raises(ValueError, match="num_chunks"):
        matmul_all_reduce(torch.zeros(4, 1, 2), torch.zeros(3, 2), plan=OpPlan("flash", num_chunks=0))
