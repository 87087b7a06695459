"""Tier: numerics on 2 and 4 gloo CPU processes. Prefill of any prompt length: the row-parallel all-reduce
(no SP) at sequence lengths P does not divide runs the decomposed operators (zero-padded to a multiple of P,
ops/tp_nosp/autograd.py ar_matmul_forward), never a plain all-reduce; compared with the reference
(GEMM, then dist.all_reduce) and a float64 dense formula.

Tolerances: fp32 1e-4 x the output scale, because the sums are reordered (the GEMM cut in row slices, the ring
order of the partial sums), the same bound as the divisible lengths (test_tp_nosp.py); bf16 3e-2 (the GEMMs
round to 8 bits of mantissa). Every rank must hold the same bits.
"""
import pytest
import torch

FP32, BF16 = 1e-4, 3e-2


@pytest.mark.parametrize("world,s", [(2, 7), (2, 3), (4, 5), (4, 3), (4, 6), (4, 9)])
@pytest.mark.parametrize("algo", ["flash", "flash_bidir", "slicing"])
def test_row_all_reduce_any_length_runs_decomposed(pools, world, s, algo):
    res = pools(world).run("tests.gloo.mp_tp_nosp_uneven:row", algo, s, 2, 8, 6)
    for r in res:
        assert r["walked"] or algo == "slicing", "the decomposed walk must run, not a plain all-reduce"
        assert r["shape"] == (s, 2, 6)
        tol = FP32 * max(1.0, r["scale"])
        assert r["y_vs_ref"] < tol and r["y"] < tol and r["dx"] < tol and r["dw"] < tol, r
    assert all(torch.equal(res[0]["y_out"], r["y_out"]) for r in res)  # replicated


def test_row_all_reduce_odd_length_bf16(pools):
    res = pools(2).run("tests.gloo.mp_tp_nosp_uneven:row", "flash", 7, 2, 16, 8, dtype="bfloat16")
    for r in res:
        assert r["walked"] and r["y_vs_ref"] < BF16 * max(1.0, r["scale"]) and r["y"] < BF16 * max(1.0, r["scale"])
    assert torch.equal(res[0]["y_out"], res[1]["y_out"])


@pytest.mark.parametrize("world,s", [(2, 5), (4, 7)])
def test_column_dgrad_all_reduce_any_length(pools, world, s):
    res = pools(world).run("tests.gloo.mp_tp_nosp_uneven:column", "flash", s, 2, 6, 8)
    for r in res:
        assert not r["walked_forward"] and r["walked"]  # the forward is local; the dgrad all-reduce walked
        tol = FP32 * max(1.0, r["scale"])
        assert r["dx"] < tol and r["dw"] < tol, r
    assert all(torch.equal(res[0]["dx_out"], r["dx_out"]) for r in res)
