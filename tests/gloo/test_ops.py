"""Tier 2 (2-4 gloo processes): operator numerics against the unfused reference and a float64 formula.

Tolerances (relative to the reference's max magnitude):
- all-gather + GEMM forward: bitwise equal to algo="reference" (no sum is reordered: each output row
  is the same GEMM row as in the one big GEMM). That holds while BLAS computes a row the same way
  whatever the row count: with MKL here, for slices of >= 16 rows (s/P * b) and >= 2 output columns.
  Smaller slices take a gemv / small-M kernel with another sum order along h, so the random tiny
  shapes below compare with FP32_TOL instead;
- everything that sums across ranks or slices (RS forward, dx of the column layer, all dw): FP32_TOL,
  because the order of the sum differs from the reference collective / the one big GEMM;
- bf16: BF16_TOL, bf16 inputs carry 8 mantissa bits (2^-8 = 0.4 %), products are rounded to bf16
  before the fp32 sum: 8 bf16 ulps (measured at most 1.6 ulps in test_low_precision);
- fp16: FP16_TOL, 11 mantissa bits (2^-11 = 0.05 %), the same rounding steps: 4 fp16 ulps (measured at most
  1.4 ulps). Sums kept in bf16 instead of fp32 (mutation fp16_sums_in_bf16) give 7-12 fp16 ulps: caught.
"""
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_flashoverlap import ALGOS

FP32_TOL = 1e-5
BF16_TOL = 8 * 2 ** -8  # 3.1e-2
FP16_TOL = 4 * 2 ** -11  # 2.0e-3
LOW_TOL = {"bfloat16": BF16_TOL, "float16": FP16_TOL}
CHUNKS = 3


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("algo", ALGOS)
def test_all_gather_matmul_fp32(pools, p, algo):
    # s/P = 8, b = 3: 24 rows per ring slice, 12 per bidirectional half, >= 6 per slicing chunk x P
    for r in pools(p).run("tests.gloo.mp_ops:ag_matmul", algo, 8 * p, 3, 16, 4 * p, num_chunks=CHUNKS):
        assert r["y_vs_ref_bitwise"], "forward differs from the reference: no sum is reordered, must be exact"
        for k in ("y", "dx", "dw", "db"):
            assert r[k] < FP32_TOL, (k, r[k])


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("algo", ALGOS)
def test_matmul_reduce_scatter_fp32(pools, p, algo):
    for r in pools(p).run("tests.gloo.mp_ops:matmul_rs", algo, 4 * p, 3, 4 * p, 16, num_chunks=CHUNKS):
        assert r["y_dtype_ok"]
        for k in ("y_vs_ref", "y", "dx", "dw"):
            assert r[k] < FP32_TOL, (k, r[k])


@pytest.mark.parametrize("algo", ["flash", "flash_bidir", "slicing"])
def test_keep_gathered_gives_same_grads(pools, algo):
    for r in pools(2).run("tests.gloo.mp_ops:ag_matmul", algo, 8, 2, 16, 8, num_chunks=2, keep=True):
        for k in ("y", "dx", "dw", "db"):
            assert r[k] < FP32_TOL, (k, r[k])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("algo", ["flash", "flash_bidir", "slicing"])
def test_low_precision(pools, dtype, algo):
    tol = LOW_TOL[dtype]
    for r in pools(3).run("tests.gloo.mp_ops:ag_matmul", algo, 12, 2, 32, 9, dtype=dtype, num_chunks=2):
        for k in ("y", "dx", "dw", "db"):
            assert r[k] < tol, (k, r[k])
    for r in pools(3).run("tests.gloo.mp_ops:matmul_rs", algo, 12, 2, 9, 32, dtype=dtype, num_chunks=2):
        assert r["y_dtype_ok"]
        for k in ("y", "dx", "dw"):
            assert r[k] < tol, (k, r[k])


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(p=st.sampled_from([2, 3, 4]), rows=st.integers(1, 5), b=st.integers(1, 3), h=st.integers(1, 24),
       n_per=st.integers(1, 6), algo=st.sampled_from(ALGOS), chunks=st.integers(1, 4), seed=st.integers(0, 99))
def test_random_shapes(pools, p, rows, b, h, n_per, algo, chunks, seed):
    """Odd sizes: local rows not divisible by the chunk count or by 2 (bidirectional halves), h = 1."""
    for r in pools(p).run("tests.gloo.mp_ops:ag_matmul", algo, rows * p, b, h, n_per * p, seed=seed, num_chunks=chunks):
        for k in ("y_vs_ref", "y", "dx", "dw", "db"):
            assert r[k] < FP32_TOL, (k, r[k])
    for r in pools(p).run("tests.gloo.mp_ops:matmul_rs", algo, rows * p, b, n_per * p, h, seed=seed, num_chunks=chunks):
        for k in ("y_vs_ref", "y", "dx", "dw"):
            assert r[k] < FP32_TOL, (k, r[k])


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_hop_chunks_exact_where_no_sum_is_reordered(pools, p, dtype):
    """c row sub-chunks per hop against the same ring with c = 1. s/P = 5 (odd: uneven sub-chunks 2,1,1,1 at
    c = 4), b = 16 so every sub-chunk slice has >= 16 GEMM rows (the BLAS row-invariance above).
    Bitwise: AG forward (rows independent; also vs the reference), RS forward and the column dx (each partial
    is the same GEMM cut by rows, summed in the same ring order), the row dx (rows of AG(dy) @ w).
    Close: dw (the sum over slices has c times as many terms: reordered), FP32_TOL / BF16_TOL vs float64."""
    tol = FP32_TOL if dtype == "float32" else BF16_TOL
    for c in (1, 2, 3, 4):
        for r in pools(p).run("tests.gloo.mp_ops:hop_chunks_vs_one", 5 * p, 16, 16, 3 * p, c, dtype=dtype):
            for k in ("col.y", "col.dx", "row.y", "row.dx"):
                assert r[f"{k}.same_as_c1"], (c, k)
            assert r["col.y.same_as_reference"], c
            assert r["ag_slices"] == p * c  # the sub-chunks really ran: one GEMM slice per sub-chunk per block
            for k in ("col.y", "col.dx", "col.dw", "row.y", "row.dx", "row.dw"):
                assert r[k] < tol, (c, k, r[k])


def test_hop_chunks_bad_requests_name_the_fix(pools):
    r = pools(2).run("tests.gloo.mp_ops:hop_chunks_errors")[0]
    assert "integer >= 1" in r["zero"] and "integer >= 1" in r["float"]
    assert "knob of algo 'flash'" in r["slicing"] and "knob of algo 'flash'" in r["bidir"]
    assert r["forced_ok"] is None  # force_reference() overrides the algo: the flash knob is then unused


@pytest.mark.parametrize("keep", [False, True])
def test_reference_column_backward_overlaps_as_stock_megatron(pools, keep):
    # Megatron's column backward under SP (LinearWithGradAccumulationAndAsyncCommunication) re-gathers x
    # asynchronously under the dgrad GEMM and reduce-scatters the dgrad asynchronously under the wgrad GEMM; the
    # operators' stock baseline must do no less (a blocking re-gather and RS would be a slower baseline than stock).
    want = [("compute", "whole GEMM"), ("post", "reduce-scatter"), ("wait", "reduce-scatter")]
    if not keep:
        want = [("post", "all-gather"), want[0], ("wait", "all-gather")] + want[1:]
    for events in pools(2).run("tests.gloo.mp_ops:reference_column_backward_trace", keep=keep):
        assert events == want, events
