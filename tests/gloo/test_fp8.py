"""Tier 2 (2-3 gloo processes): the four FP8 TP operators (OpPlan(fp8=...) on all_gather_matmul,
matmul_reduce_scatter, matmul_all_reduce, matmul_allreduce_dgrad) against their unfused FP8 paths
(algo="reference": the stock collective, one scaled GEMM), against the recipe written in plain torch
(tests/gloo/mp_fp8.py), and the bytes their rings send.

Exact where no sum is reordered: y (each ring or chunk slice is rows of the one scaled GEMM, and torch's CPU
_scaled_mm computes a row the same whatever the row count), db, dW where it is one GEMM on AG(x) (reference,
slicing, keep_gathered), dx where both reduce through the stock collective (slicing) or at P = 2 with fp32
partials on the wire (one fp32 add, commutative). Tolerances,
each relative to the largest value of the compared tensor:
- Y_TOL, y against the fp64 GEMM of the dequantized operands: y is rounded once to bf16 (half an ulp: 2^-8 of
  the largest value); fp32 accumulation adds far less; 2^-7;
- DX_TOL * P, dx against the recipe's fp64 sum of every rank's partial: each of the P - 1 hops rounds a partial
  sum to bf16 on the wire and the result is rounded once more (2^-8 each at most); measured at most 0.31 % at
  P = 2, 0.42 % at P = 3;
- DW_TOL, the flash dW (P fp32 slices summed) against the one GEMM: fp32 sums in another order, rounded once to
  bf16: one bf16 ulp apart at most, 2^-7.
The row operator: dx is rows of the recipe's one scaled GEMM on every path (exact); dW as the column's; y is the
column's dx in reverse (partials summed over ranks): the fp32 sum of the recipe's partials bit for bit where
the sum is one fp32 add of two partials (P = 2, fp32 on the wire), the reference's bit for bit through the stock
reduce-scatter (slicing), else within DX_TOL * P of the fp64 sum (bf16 wire: P - 1 roundings and one more;
measured at most 0.45 % at P = 2, 0.43 % at P = 3).
Without SP: the row operator's y is the row's y all-gathered (the same bounds, the same bits on every rank),
its dx and dW local GEMMs (exact); the column operator's y is one local GEMM (exact), its dx the column's dx
(replicated), its dW the sum of P - 1 fp32 tail pieces (exact at P = 2, DW_TOL otherwise). gloo sums a chunk's
all-reduce in another order than the whole tensor's at P = 3, so slicing equals the reference only at P = 2.
"""
import pytest
import torch

from megatron_flashoverlap import ALGOS

Y_TOL = 2 ** -7
DX_TOL = 2 ** -8
DW_TOL = 2 ** -7
STOCK = ("reference", "slicing")  # dx through the stock reduce-scatter, dW one scaled GEMM on AG(x)


def _check(r, p, whole_dw):
    assert r["y_is_reference"] and r["y_is_recipe"], r
    assert r["db_is_reference"], r
    assert r["y_vs_fp64"] < Y_TOL, r
    assert r["dx_vs_recipe"] < DX_TOL * p, r
    if whole_dw:
        assert r["dw_is_reference"] and r["dw_is_recipe"], r
    else:
        assert r["dw_vs_reference"] < DW_TOL and r["dw_vs_recipe"] < DW_TOL, r


@pytest.mark.parametrize("p", [2, 3])
@pytest.mark.parametrize("algo", ALGOS)
def test_every_algo_is_the_unfused_fp8_and_the_recipe(pools, p, algo):
    for r in pools(p).run("tests.gloo.mp_fp8:ag_fp8", algo):
        _check(r, p, algo in STOCK)
        assert r["dx_is_reference"] or algo not in STOCK, r


@pytest.mark.parametrize("algo,knobs", [
    ("flash", {"hop_chunks": 2}),                 # two sub-chunk slices per hop, 16 tokens each
    ("flash", {"keep": True}),                    # dW from the kept AG(x): one GEMM, exact
    ("flash_bidir", {"wire": "fp32"}),            # fp32 partials on the wire: dx exact at P = 2
    ("flash", {"fmt": "e4m3", "margin": 2}),      # e4m3 gradients, a margin
])
def test_ring_knobs_keep_the_numerics(pools, algo, knobs):
    for r in pools(2).run("tests.gloo.mp_fp8:ag_fp8", algo, **knobs):
        _check(r, 2, knobs.get("keep", False))
        if knobs.get("wire") == "fp32":
            assert r["dx_is_reference"], r


@pytest.mark.parametrize("p", [2, 3])
@pytest.mark.parametrize("algo", ["flash", "flash_bidir"])
def test_the_ring_carries_one_byte_per_element(pools, p, algo):
    """Counted per c10d send (numel * element_size): forward, P - 1 shards of FP8 bytes, half of bf16's, no scale;
    backward, the x shards again in FP8 beside the dgrad partials in bf16 (the wire dtype, unchanged)."""
    for r in pools(p).run("tests.gloo.mp_fp8:wire_bytes", algo):
        assert r["fp8_fwd"] == ((p - 1) * r["x_shard_numel"], ["torch.uint8"]), r
        assert 2 * r["fp8_fwd"][0] == r["bf16_fwd"][0], r
        assert r["fp8_bwd"] == ((p - 1) * (2 * r["dx_numel"] + r["x_shard_numel"]), ["torch.bfloat16", "torch.uint8"])


@pytest.mark.parametrize("algo", ["flash", "reference"])
def test_delayed_scales_agree_over_the_group_and_lag_a_step(pools, algo):
    res = pools(2).run("tests.gloo.mp_fp8:delayed_steps", algo)
    for r in res:
        assert r["steps_match_recipe"] == [True, True], r
        assert r["scales"] == r["want"], r  # the window's max of the global amaxes: the same on every rank
    assert res[0]["scales"] == res[1]["scales"]


def test_wgrad_slices_cuda_cannot_run_are_refused(pools):
    for msg in pools(2).run("tests.gloo.mp_fp8:hop_slices_too_small"):
        assert msg is not None and "[8, 8] per GEMM slice" in msg and "multiple of 16" in msg, msg


def _check_row(r, p, algo, wire="input", same_sum=STOCK):
    """same_sum: the algos whose y is summed as the reference's is (the stock collective's order)."""
    assert r["dx_is_recipe"] and r["dx_is_reference"], r
    assert r["y_vs_recipe"] < DX_TOL * p, r
    assert r["y_is_reference"] or algo not in same_sum, r
    if algo in STOCK:
        assert r["dw_is_reference"] and r["dw_is_recipe"], r
    else:
        assert r["dw_vs_reference"] < DW_TOL and r["dw_vs_recipe"] < DW_TOL, r
    if wire == "fp32" and p == 2:
        assert r["y_is_fp32_sum"] and r["y_is_reference"], r


@pytest.mark.parametrize("p", [2, 3])
@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("wire", ["input", "fp32"])
def test_row_every_algo_is_the_unfused_fp8_and_the_recipe(pools, p, algo, wire):
    for r in pools(p).run("tests.gloo.mp_fp8:rs_fp8", algo, wire=wire):
        _check_row(r, p, algo, wire)


@pytest.mark.parametrize("algo,knobs", [
    ("flash", {"hop_chunks": 2}),                 # two sub-chunk slices per hop, 16 tokens each
    ("flash", {"fmt": "e4m3", "margin": 2}),      # e4m3 gradients, a margin
    ("flash", {"into": True}),                    # dW slices added into an fp32 main_grad
    ("slicing", {"into": True}),                  # the one dW GEMM added into it
])
def test_row_ring_knobs_keep_the_numerics(pools, algo, knobs):
    for r in pools(2).run("tests.gloo.mp_fp8:rs_fp8", algo, **knobs):
        _check_row(r, 2, algo)


@pytest.mark.parametrize("p", [2, 3])
@pytest.mark.parametrize("algo", ["flash", "flash_bidir"])
def test_the_row_ring_carries_bf16_partials_forward_and_fp8_dy_backward(pools, p, algo):
    """Counted per c10d send (numel * element_size): forward, the P - 1 partial blocks in bf16 (the wire dtype)
    with or without FP8, never FP8; backward, the P - 1 dy shards in FP8, one byte per element, half of bf16's
    (dy's amax travels in an all-reduce, not a send)."""
    for r in pools(p).run("tests.gloo.mp_fp8:row_wire_bytes", algo):
        assert r["fp8_fwd"] == r["bf16_fwd"] == ((p - 1) * 2 * r["y_numel"], ["torch.bfloat16"]), r
        assert r["fp8_bwd"] == ((p - 1) * r["dy_shard_numel"], ["torch.uint8"]), r
        assert r["bf16_bwd"] == (2 * r["fp8_bwd"][0], ["torch.bfloat16"]), r


@pytest.mark.parametrize("op", ["matmul_reduce_scatter_fp8", "matmul_all_reduce_fp8"])
@pytest.mark.parametrize("algo", ["flash", "reference"])
def test_row_delayed_scales_agree_over_the_group_and_lag_a_step(pools, algo, op):
    res = pools(2).run("tests.gloo.mp_fp8:row_delayed_steps", algo, op=op)
    for r in res:
        assert r["steps_match_recipe"] == [True, True], r
        assert r["scales"] == r["want"], r  # x, w, dy: the window's max of the global amaxes, on every rank
    assert res[0]["scales"] == res[1]["scales"]


def test_row_wgrad_slices_cuda_cannot_run_are_refused(pools):
    for msg in pools(2).run("tests.gloo.mp_fp8:row_hop_slices_too_small"):
        assert msg is not None and "matmul_reduce_scatter" in msg and "[8, 8] per GEMM slice" in msg, msg


# ---------------------------------------------------------------- without sequence parallelism (all-reduce)

def _all_reduce_row(res, p, algo, wire):
    for r in res:
        _check_row(r, p, algo, wire, same_sum=STOCK if p == 2 else ("reference",))
        assert r["dw_is_reference"] and r["dw_is_recipe"], r  # local: one GEMM
    assert all(torch.equal(res[0]["y_out"], r["y_out"]) for r in res)  # replicated: the same bits


def _all_reduce_column(res, p, algo, wire):
    for r in res:
        assert r["y_is_recipe"] and r["y_is_reference"] and r["db_is_reference"], r
        assert r["dx_vs_recipe"] < DX_TOL * p, r
        assert r["dw_is_reference"] and r["dw_vs_recipe"] < DW_TOL and (r["dw_is_recipe"] or p > 2), r
        if algo == "reference" or (p == 2 and (algo == "slicing" or wire == "fp32")):
            assert r["dx_is_reference"], r
    assert all(torch.equal(res[0]["dx_out"], r["dx_out"]) for r in res)  # replicated input gradient


@pytest.mark.parametrize("p", [2, 3])
@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("wire", ["input", "fp32"])
@pytest.mark.parametrize("worker,check", [("ar_fp8", _all_reduce_row), ("dgrad_ar_fp8", _all_reduce_column)])
def test_the_all_reduce_pair_is_the_unfused_fp8_and_the_recipe(pools, p, algo, wire, worker, check):
    check(pools(p).run(f"tests.gloo.mp_fp8:{worker}", algo, wire=wire), p, algo, wire)


@pytest.mark.parametrize("algo,kw", [
    ("flash", {"s": 40}),                          # 40 rows on 3 ranks: zero-padded to 42 for the ring
    ("slicing", {"s": 40}),
    ("flash", {"s": 1, "b": 16, "decode": "reference"}),  # decode-shaped: one FP8 GEMM, then the decode all-reduce
])
def test_all_reduce_row_uneven_and_decode(pools, algo, kw):
    res = pools(3).run("tests.gloo.mp_fp8:ar_fp8", algo, **kw)
    for r in res:
        assert r["dx_is_recipe"] and r["dw_is_recipe"] and r["y_vs_recipe"] < DX_TOL * 3, r
        assert r["y_is_reference"] or "decode" not in kw, r  # the decode all-reduce is stock's here
    assert all(torch.equal(res[0]["y_out"], r["y_out"]) for r in res)


@pytest.mark.parametrize("algo", ["flash", "flash_bidir"])
def test_the_all_reduce_carries_bf16_partials_never_fp8(pools, algo):
    """Counted per c10d send: the row forward's and the column backward's all-reduce send the same bf16 bytes
    with the FP8 recipe as without (partials and reduced blocks in the activation dtype)."""
    for r in pools(2).run("tests.gloo.mp_fp8:nosp_wire_bytes", algo):
        for key in ("row_fwd", "column_bwd"):
            assert r[f"fp8_{key}"] == r[f"bf16_{key}"] and r[f"fp8_{key}"][1] == ["torch.bfloat16"], r
