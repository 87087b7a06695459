"""Tier: pure (no processes): the four FP8 TP operators (all-gather + GEMM, GEMM + reduce-scatter, GEMM +
all-reduce, GEMM with an all-reduced dgrad) in a group of one against the recipe in plain torch
(tests/support/fp8_recipe.py), and every refusal, each before any transfer and naming its fix.

A group of one runs the unfused FP8 path: one scaled GEMM each for y, dx and dW, the same calls the recipe
makes, so every comparison is exact (the row's y is its one fp32 partial rounded once to bf16, as the
recipe's).
"""
import pytest
import torch

import megatron_flashoverlap as fo
from megatron_flashoverlap.ops.registry import force_reference, resolve
from megatron_flashoverlap.ops.tp_nosp.autograd import wgrad_spans
from tests.support.fp8_recipe import E4M3, E5M2, recipe_backward, recipe_forward, recipe_row

BF16 = torch.bfloat16
HYBRID = fo.Fp8Recipe("hybrid", margin=1)


def _operands(s=16, b=2, h=32, n=16, seed=0, dtype=BF16):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(s, b, h, generator=g) * 3).to(dtype).requires_grad_()
    w = (torch.randn(n, h, generator=g) / h ** 0.5).to(dtype).requires_grad_()
    return x, w, torch.randn(n, generator=g).to(dtype).requires_grad_(), torch.randn(s, b, n, generator=g).to(dtype)


@pytest.mark.parametrize("fmt,grad", [("hybrid", E5M2), ("e4m3", E4M3)])
def test_a_group_of_one_is_the_recipe_forward_and_backward(fmt, grad):
    x, w, bias, dy = _operands()
    y = fo.all_gather_matmul(x, w, bias=bias, plan=fo.OpPlan("flash", fp8=fo.Fp8Recipe(fmt, margin=1)))
    y.backward(dy)
    y_want, x8 = recipe_forward(x.detach(), w.detach(), bias.detach(), margin=1)
    dx_want, dws = recipe_backward(x8, dy, w.detach(), 1, grad, margin=1)
    assert torch.equal(y, y_want)
    assert torch.equal(x.grad, dx_want.to(BF16))  # one partial: the fp32 GEMM rounded once
    assert torch.equal(w.grad, dws[0]) and torch.equal(bias.grad, dy.sum((0, 1)))


@pytest.mark.parametrize("fmt,grad", [("hybrid", E5M2), ("e4m3", E4M3)])
@pytest.mark.parametrize("wire", ["input", "fp32"])
def test_a_row_group_of_one_is_the_recipe_forward_and_backward(fmt, grad, wire):
    x, w, _, dy = _operands(h=32, n=16)  # x [s, b, k/P = 32], w [h = 16, k/P], dy [s, b, h]
    y = fo.matmul_reduce_scatter(x, w, plan=fo.OpPlan("flash", wire_dtype=wire, fp8=fo.Fp8Recipe(fmt, margin=1)))
    y.backward(dy)
    parts, dx_want, dws = recipe_row(x.detach(), w.detach(), dy, 1, grad, margin=1)
    assert torch.equal(y, parts[0].to(BF16))
    assert torch.equal(x.grad, dx_want) and torch.equal(w.grad, dws[0])


@pytest.mark.parametrize("algo", ["flash", "reference"])
def test_the_all_reduce_pair_in_a_group_of_one_is_the_recipe(algo):
    x, w, bias, dy = _operands(h=32, n=16)
    plan = fo.OpPlan(algo, fp8=HYBRID)
    y = fo.matmul_all_reduce(x, w, plan=plan)  # row: x [s, b, k = 32], w [h = 16, k]
    y.backward(dy)
    parts, dx_want, dws = recipe_row(x.detach(), w.detach(), dy, 1, E5M2, margin=1)
    assert torch.equal(y, parts[0].to(BF16)) and torch.equal(x.grad, dx_want) and torch.equal(w.grad, dws[0])
    x.grad = w.grad = None
    y = fo.matmul_allreduce_dgrad(x, w, bias=bias, plan=plan)  # column: x [s, b, h = 32], w [n = 16, h]
    y.backward(dy)
    y_want, x8 = recipe_forward(x.detach(), w.detach(), bias.detach(), margin=1)
    dx_want, dws = recipe_backward(x8, dy, w.detach(), 1, E5M2, margin=1)
    assert torch.equal(y, y_want) and torch.equal(x.grad, dx_want.to(BF16)) and torch.equal(w.grad, dws[0])
    assert torch.equal(bias.grad, dy.sum((0, 1)))


@pytest.mark.parametrize("op", [fo.matmul_reduce_scatter, fo.matmul_all_reduce, fo.matmul_allreduce_dgrad])
def test_wgrad_into_gets_the_fp32_dw(op):
    """dW added into an fp32 buffer (Megatron's main_grad) is the one scaled GEMM's fp32 result: rounded once, the
    recipe's bf16 dW."""
    x, w, _, dy = _operands(h=32, n=16)
    into = torch.zeros(w.shape)
    op(x, w, plan=fo.OpPlan(fp8=HYBRID), wgrad=fo.WgradRoute(into=into)).backward(dy)
    if op is fo.matmul_allreduce_dgrad:
        want = recipe_backward(recipe_forward(x.detach(), w.detach(), None, margin=1)[1], dy, w.detach(), 1, E5M2,
                               margin=1)[1][0]
    else:
        want = recipe_row(x.detach(), w.detach(), dy, 1, E5M2, margin=1)[2][0]
    assert torch.equal(into.to(BF16), want) and w.grad is None  # no grad_added_to_main_grad: no dummy


@pytest.mark.parametrize("rows,batch,pieces,want", [
    (4096, 1, 7, 7), (40, 2, 2, 2), (8, 2, 3, 1), (48, 2, 2, 2), (16, 16, 3, 3)])
def test_the_all_reduce_wgrad_tail_is_cut_at_multiples_of_16_tokens(rows, batch, pieces, want):
    spans = wgrad_spans(rows, batch, pieces)
    assert len(spans) == want and spans[0][0] == 0 and spans[-1][1] == rows
    assert all(a < b and (b - a) * batch % 16 == 0 for a, b in spans)
    assert all(p[1] == q[0] for p, q in zip(spans, spans[1:]))


def test_forward_only_rows_need_no_multiple_of_16():
    """Rows are the GEMM's M, which CUDA leaves free; only a weight gradient multiplies over tokens."""
    x, w, bias, dy = _operands(s=5, b=1)
    y = fo.all_gather_matmul(x.detach(), w.detach(), bias=bias.detach(), plan=fo.OpPlan(fp8=HYBRID))
    assert torch.equal(y, recipe_forward(x.detach(), w.detach(), bias.detach(), margin=1)[0])
    y = fo.matmul_reduce_scatter(x.detach(), w.detach(), plan=fo.OpPlan(fp8=HYBRID))
    assert torch.equal(y, recipe_row(x.detach(), w.detach(), dy, 1, E5M2, margin=1)[0][0].to(BF16))
    for op in (fo.all_gather_matmul, fo.matmul_reduce_scatter, fo.matmul_all_reduce, fo.matmul_allreduce_dgrad):
        with pytest.raises(ValueError, match=rf"{op.__name__}: .*\[5\] per GEMM slice.*multiple of 16"):
            op(x.detach(), w, plan=fo.OpPlan(fp8=HYBRID))


def _call(x, w, **kw):
    return lambda: fo.all_gather_matmul_fp8(x, w, **kw)


def _row(x, w, **kw):
    return lambda: fo.matmul_reduce_scatter_fp8(x, w, **kw)


_X, _W, _, _ = _operands()
DELAYED = fo.Fp8Recipe(recipe="delayed")


@pytest.mark.parametrize("call,fix", [
    (_call(_X[..., :24], _W[:, :24], plan=fo.OpPlan(fp8=HYBRID)), "hidden size \\(24\\).*multiples of 16"),
    (_call(_X, _W[:8], plan=fo.OpPlan(fp8=HYBRID)), "output features per rank \\(8\\)"),
    (_call(_X.double(), _W.double(), plan=fo.OpPlan(fp8=HYBRID)), "the input is torch.float64: cast it"),
    (_call(_X, _W, plan=fo.OpPlan(fp8=DELAYED)), "pass scales=DelayedScales"),
    (_call(_X, _W, plan=fo.OpPlan(fp8=HYBRID), scales=fo.DelayedScales(DELAYED)), "pass scales=None"),
    (_call(_X, _W, plan=fo.OpPlan(fp8=HYBRID), wgrad=fo.WgradRoute(fn=lambda dy, x: None)), "pass wgrad_into"),
    (_call(_X, _W, plan=fo.OpPlan()), "plan.fp8 is None"),
    (_row(_X[..., :24], _W[:, :24], plan=fo.OpPlan(fp8=HYBRID)), "input features per rank \\(24\\).*multiples of 16"),
    (_row(_X, _W[:8], plan=fo.OpPlan(fp8=HYBRID)), "the hidden size \\(8\\)"),
    (_row(_X.double(), _W.double(), plan=fo.OpPlan(fp8=HYBRID)), "the input is torch.float64: cast it"),
    (_row(_X, _W, plan=fo.OpPlan(fp8=DELAYED)), "pass scales=DelayedScales"),
    (_row(_X, _W, plan=fo.OpPlan(fp8=HYBRID), wgrad=fo.WgradRoute(fn=lambda dy, x: None)), "pass wgrad_into"),
    (_row(_X, _W, plan=fo.OpPlan()), "matmul_reduce_scatter_fp8: plan.fp8 is None"),
    (lambda: fo.matmul_all_reduce_fp8(_X[..., :24], _W[:, :24], plan=fo.OpPlan(fp8=HYBRID)),
     "input features per rank \\(24\\)"),
    (lambda: fo.matmul_allreduce_dgrad_fp8(_X, _W[:8], plan=fo.OpPlan(fp8=HYBRID)), "output features per rank \\(8\\)"),
    (lambda: fo.matmul_all_reduce(_X[:5], _W, plan=fo.OpPlan(fp8=HYBRID)), "\\[10\\] per GEMM slice.*pad the sequence"),
    (lambda: fo.matmul_allreduce_dgrad_fp8(_X, _W, plan=fo.OpPlan(fp8=DELAYED)), "pass scales=DelayedScales"),
    (lambda: fo.matmul_all_reduce_fp8(_X, _W, plan=fo.OpPlan()), "matmul_all_reduce_fp8: plan.fp8 is None"),
    (lambda: resolve("query_split_attention", fo.OpPlan(fp8=HYBRID)), "fp8 is not a knob"),
    (lambda: resolve("matmul_wgrad_reduce_scatter", fo.OpPlan(fp8=HYBRID)), "fp8 is not a knob"),
    (lambda: fo.OpPlan(fp8="e4m3"), "must be an Fp8Recipe"),
])
def test_what_fp8_cannot_run_is_refused_with_the_fix(call, fix):
    with pytest.raises(ValueError, match=fix):
        call()


def test_force_reference_keeps_the_recipe():
    """The unfused path of an FP8 plan is the unfused FP8 path, never a bf16 GEMM."""
    with force_reference():
        for op in ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce", "matmul_allreduce_dgrad"):
            assert resolve(op, fo.OpPlan("flash", fp8=HYBRID)) == fo.OpPlan("reference", fp8=HYBRID)
