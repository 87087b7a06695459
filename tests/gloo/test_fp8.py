"""Tier 2 (2-3 gloo processes): the FP8 all-gather + GEMM (all_gather_matmul with OpPlan(fp8=...)) against its
unfused FP8 path (algo="reference": the stock all-gather of the FP8 bytes, one scaled GEMM), against the recipe
written in plain torch (tests/gloo/mp_fp8.py), and the bytes its ring sends.

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
"""
import pytest

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
