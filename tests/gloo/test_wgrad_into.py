"""Tier 2 (2 gloo processes): `wgrad_into`, dW added into a caller's fp32 buffer (Megatron's
gradient_accumulation_fusion in pure torch), for every operator, algo and dtype. Bodies: mp_wgrad_into.py.

Tolerances (relative to max |dW| of the float64 formula):
- buffer increment vs float64: 1e-6. fp32 sums of s*b = 48 products per element plus one add onto the
  buffer's earlier value; bf16 inputs meet the same bar, since a bf16 x bf16 product is exact in fp32.
- vs the plain run's dW (weight.grad): fp32 1e-6 (the same sums, the order differs slice by slice);
  bf16 4e-3, because the plain dW is rounded once to bf16 (half an ulp: up to 2^-8 relative).
- dx: bitwise equal to the plain run (the fusion touches only the weight gradient).
"""
import pytest

from megatron_flashoverlap import ALGOS

CASE = "tests.gloo.mp_wgrad_into:case"
OPS = ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce", "matmul_allreduce_dgrad")
DDP_FLAGS = {"grad_added_to_main_grad": False}  # what Megatron's DDP puts on every trainable parameter


def _check_numbers(r, dtype):
    assert r["err_vs_float64"] <= 1e-6, r
    assert r["err_vs_plain"] <= (1e-6 if dtype == "float32" else 4e-3), r
    assert r["dx_equal"], "dx must not change when dW goes into the buffer"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("op", OPS)
def test_wgrad_goes_into_the_buffer(pools, op, algo, dtype):
    for r in pools(2).run(CASE, op, algo, dtype, flags=DDP_FLAGS, timeout=120):
        _check_numbers(r, dtype)
        # Megatron's contract: the flag set, a dummy of the weight's shape in the input dtype handed to autograd
        assert r["flag"] is True
        assert r["grad"][:2] == (r["shape"], f"torch.{dtype}")


@pytest.mark.parametrize("algo", ["flash", "flash_bidir", "slicing"])
def test_kept_gather_adds_into_the_buffer(pools, algo):
    for r in pools(2).run(CASE, "all_gather_matmul", algo, "bfloat16", keep=True, flags=DDP_FLAGS, timeout=120):
        _check_numbers(r, "bfloat16")


@pytest.mark.parametrize("op", OPS)
def test_dummy_gradient_follows_megatron(pools, op):
    plain = pools(2).run(CASE, op, "flash", flags={}, timeout=120)[0]
    assert plain["grad"] is None and plain["flag"] is None  # no DDP attribute: nothing goes to .grad
    zero = pools(2).run(CASE, op, "flash", flags=dict(DDP_FLAGS, zero_out_wgrad=True), timeout=120)[0]
    assert zero["grad"] == (zero["shape"], "torch.float32", True) and zero["flag"] is True  # zeros: DDP adds it


def test_group_of_one_rank_adds_into_the_buffer(pools):
    for r in pools(2).run("tests.gloo.mp_wgrad_into:size_one_group", timeout=120):
        assert r["err"] <= 1e-6 and r["flag"] is True and r["grad_shape"] == (8, 12)


def test_wrong_buffer_shape_is_a_value_error(pools):
    msg = pools(2).run("tests.gloo.mp_wgrad_into:bad_into", timeout=120)[0]
    assert msg and "wgrad_into" in msg and "main_grad" in msg
