"""Tier: pure (no processes). The FP8 recipe math and CUDA's _scaled_mm rules, against formulas written here.

Expected values come from the recipe's definition (scale = fp8_max / amax / 2^margin; a saturating cast; the
amax window of the delayed recipe), not from the code under test. Exact comparisons throughout: every formula
here runs the same fp32 operations as the code, so any difference is a different recipe, not rounding.
"""
import math

import pytest
import torch

from megatron_flashoverlap.runtime.fp8 import FORMATS, DelayedScales, Fp8Recipe, cast, fmt, quantize, scale_for
from megatron_flashoverlap.runtime.scaled_mm import check_scaled_mm, column_major, fp8_rows_writer, scaled_mm

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
ONE = torch.tensor(1.0)


def test_format_maxima_are_the_dtypes():
    assert FORMATS["e4m3"].max == 448.0 == torch.finfo(E4M3).max
    assert FORMATS["e5m2"].max == 57344.0 == torch.finfo(E5M2).max


@pytest.mark.parametrize("kw,flag", [({"format": "e5m2"}, "--fp8-format"), ({"recipe": "mxfp8"}, "--fp8-recipe"),
                                     ({"margin": -1}, "--fp8-margin"), ({"amax_history_len": 0}, "--fp8-amax-history-len"),
                                     ({"amax_compute_algo": "mean"}, "--fp8-amax-compute-algo"),
                                     ({"interval": 0}, "--fp8-interval"), ({"margin": True}, "--fp8-margin")])
def test_a_bad_recipe_names_the_flag(kw, flag):
    with pytest.raises(ValueError, match=flag):
        Fp8Recipe(**kw)


def test_hybrid_casts_gradients_to_e5m2_only():
    assert [fmt(Fp8Recipe("hybrid"), r).dtype for r in ("input", "weight", "grad_output")] == [E4M3, E4M3, E5M2]
    assert {fmt(Fp8Recipe("e4m3"), r).dtype for r in ("input", "weight", "grad_output")} == {E4M3}


@pytest.mark.parametrize("amax,margin,want", [(2.0, 0, 224.0), (2.0, 1, 112.0), (448.0, 3, 0.125),
                                              (0.0, 0, 7.0), (math.inf, 0, 7.0), (math.nan, 0, 7.0),
                                              (1e-45, 0, torch.finfo(torch.float32).max)])
def test_scale_is_max_over_amax_over_two_to_the_margin(amax, margin, want):
    """0 and non-finite amaxes keep the previous scale (7 here); a tiny one saturates at fp32's max."""
    got = scale_for(torch.tensor(amax), 448.0, margin, torch.tensor(7.0))
    assert got.item() == want


def test_quantize_saturates_and_carries_the_inverse_scale():
    x = torch.tensor([1000.0, -1000.0, 1.0, 0.0]).bfloat16()
    q = quantize(x, torch.tensor(2.0), FORMATS["e4m3"])
    assert q.data.dtype == E4M3 and q.dtype == torch.bfloat16 and q.scale_inv.item() == 0.5
    assert q.data.float().tolist() == [448.0, -448.0, 2.0, 0.0]
    big = quantize(torch.tensor([1e6, -1e6]), ONE, FORMATS["e5m2"])
    assert big.data.float().tolist() == [57344.0, -57344.0]  # not inf: the cast saturates


def test_quantize_rounds_to_the_nearest_e4m3_value():
    """e4m3 keeps 3 mantissa bits: a normal value is within half an ulp, 2^-4 relative."""
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 50
    x = x[(x.abs() > 2 ** -6) & (x.abs() < 448)]
    q = quantize(x, ONE, FORMATS["e4m3"])
    assert ((q.data.float() - x).abs() <= x.abs() * 2 ** -4).all()


def test_tensorwise_cast_uses_its_own_amax():
    x = torch.randn(32, 16, generator=torch.Generator().manual_seed(1)).bfloat16()
    q = cast(x, "input", Fp8Recipe(margin=1))
    scale = torch.tensor(448.0) / x.float().abs().max() / 2.0
    assert q.scale_inv == torch.reciprocal(scale)
    assert torch.equal(q.data.view(torch.uint8),
                       (x.float() * scale).clamp(-448, 448).to(E4M3).view(torch.uint8))


def _delayed(algo, length, interval=1, fmt="e4m3"):
    return DelayedScales(Fp8Recipe(fmt, "delayed", amax_history_len=length, amax_compute_algo=algo,
                                   interval=interval))


@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_delayed_scale_comes_from_the_window_of_earlier_steps(algo):
    amaxes, length = [3.0, 9.0, 1.0, 2.0, 0.5, 4.0], 3
    state = _delayed(algo, length)
    for t, a in enumerate(amaxes):
        want = 1.0 if t == 0 else (torch.tensor(448.0) / torch.tensor(picked)).item()  # fp32, as the recipe
        assert state.scale("input").item() == want  # this step casts with the scale of the last update
        state.record("input", torch.tensor(a / 2))  # several casts in one step: the larger amax stays
        state.record("input", torch.tensor(a))
        state.update()
        window = amaxes[max(0, t - length + 1):t + 1]
        picked = max(window) if algo == "max" else a
        assert state.history[1:, 0].tolist() == ([0.0] * length + window)[-(length - 1):]
        assert state.history[0].tolist() == [0.0, 0.0, 0.0]  # the fresh row of the next step


def test_delayed_keeps_the_scale_for_a_zero_amax_and_honours_interval_and_formats():
    state = _delayed("most_recent", 1, interval=2, fmt="hybrid")
    state.record("grad_output", torch.tensor(7.0))
    state.update()
    assert state.scales.tolist() == [1.0, 1.0, 1.0]  # update 1 of interval 2: the scales wait
    state.record("grad_output", torch.tensor(7.0))
    state.update()
    e5m2 = (torch.tensor(57344.0) / torch.tensor(7.0)).item()
    assert state.scales.tolist() == [1.0, 1.0, e5m2]  # e5m2's max; zero amaxes keep scale 1
    with pytest.raises(ValueError, match="only 'delayed'"):
        DelayedScales(Fp8Recipe())


def _fp8(*shape, seed=0, dtype=E4M3):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 4).to(dtype)


@pytest.mark.parametrize("a,b,fix", [
    (_fp8(32, 16).t(), _fp8(16, 32).t(), "a.contiguous()"),          # first operand column-major
    (_fp8(16, 32), _fp8(32, 16), "w.t\\(\\) of a row-major"),         # second row-major (CPU takes it)
    (_fp8(16, 24), _fp8(16, 24).t(), "multiples of 16"),              # k = 24
    (_fp8(16, 32), _fp8(8, 32).t(), "multiples of 16"),               # n = 8
    (_fp8(16, 32, dtype=E5M2), _fp8(16, 32, dtype=E5M2).t(), "format 'hybrid'"),
    (_fp8(16, 32).bfloat16(), _fp8(16, 32).t(), "runtime.fp8.quantize"),
])
def test_cuda_rules_are_enforced_on_cpu(a, b, fix):
    with pytest.raises(ValueError, match=fix):
        check_scaled_mm(a, b)


def test_scaled_mm_is_torchs_call_and_adds_an_fp32_bias_after():
    a, w, s_a, s_b = _fp8(8, 32), _fp8(16, 32, seed=1), torch.tensor(0.37), torch.tensor(1.9)
    bias = torch.randn(16, generator=torch.Generator().manual_seed(2))
    want = torch._scaled_mm(a, w.t(), scale_a=s_a, scale_b=s_b, out_dtype=torch.bfloat16, bias=bias.bfloat16())
    assert torch.equal(scaled_mm(a, w.t(), s_a, s_b, torch.bfloat16, bias.bfloat16()), want)
    fp32 = torch._scaled_mm(a, w.t(), scale_a=s_a, scale_b=s_b, out_dtype=torch.float32) + bias
    assert torch.equal(scaled_mm(a, w.t(), s_a, s_b, torch.float32, bias), fp32)
    assert column_major(w).stride() == (1, 16) and torch.equal(column_major(w).float(), w.float())


def test_rows_writer_slices_equal_one_call():
    """Row (M) slices of one scaled GEMM are the same GEMM rows: bitwise."""
    x, w = _fp8(6, 2, 32), _fp8(16, 32, seed=1)
    q = quantize(w.float(), torch.tensor(1.0), FORMATS["e4m3"])._replace(dtype=torch.bfloat16)
    whole, parts = (torch.empty(6, 2, 16, dtype=torch.bfloat16) for _ in range(2))
    fp8_rows_writer(whole, q, torch.tensor(0.5))((0, 6), x)
    write = fp8_rows_writer(parts, q, torch.tensor(0.5))
    for a, b in ((0, 1), (1, 4), (4, 6)):
        write((a, b), x[a:b])
    assert torch.equal(whole, parts)
