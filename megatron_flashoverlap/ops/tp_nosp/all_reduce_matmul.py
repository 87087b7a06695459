"""Tensor parallel WITHOUT sequence parallel: the autograd.Functions and the public wrappers.

    matmul_all_reduce(x_k [s, b, k/P], weight_k [h, k/P], group) -> y [s, b, h]  (row-parallel, replicated)
        forward y = AR(x @ w^T)         backward dx = dy @ w, dw = dy^T x (local: dy is replicated)
    matmul_allreduce_dgrad(x [s, b, h], weight_n [n/P, h], group, bias) -> y_n [s, b, n/P]  (column-parallel)
        forward y = x @ w^T + bias      backward dx = AR(dy @ w) with the wgrad filling its tail, dw, db

The decomposition and the plain functions: ar_matmul.py. Decode (x [1, b, k/P], one new token per
sequence; or any x whose plan says `decode_step=True`: a decode-only step of an engine whose layout is
[n, 1, k/P], summed as [1, n, h]): a single row cannot be cut in rank blocks, so `matmul_all_reduce` runs the
whole GEMM and then `all_reduce(algo=plan.decode_all_reduce)` ("auto": the chooser's pick for the token bucket,
else stock). That choice is explicit: `OpPlan(decode_all_reduce=None)` runs `algo` for decode inputs too,
and algo="reference" or `force_reference()` run the reference (GEMM, then dist.all_reduce) whatever the shape.
Sequence not divisible by P (a prompt of any length, and not decode): the decomposed algorithms run on the input
zero-padded to the next multiple of P rows and return the first s rows (ar_matmul_forward); the backward's
all-reduce (column dgrad) is padded the same way.
algo= is the shorthand of plan=OpPlan(algo); the plan's knobs here (ops/registry.py): num_chunks (sequence
chunks C of the flash algos, default DEFAULT_CHUNKS; slicing: its chunks), wire_dtype (what the all-reduce's
reduce-scatter partials travel in, "input" (default, stock's bytes) or "fp32", ar_matmul.py; the decode
all-reduce always runs in the input dtype), decode_all_reduce (matmul_all_reduce).
wgrad=WgradRoute(into=...) [weight's shape] (e.g. Megatron's fp32 main_grad): dw is added into it (slice by
slice in the column backward's all-reduce tail) instead of being returned; the weight then gets Megatron's
dummy gradient (runtime/accumulate.py: weight_grad). WgradRoute(fn=...): fn(dy, x) -> the weight's autograd
gradient (e.g. the data-parallel reduce-scatter of dW, megatron/ddp/grad_sync.py): gets this rank's complete dW
operands once, after the all-reduce (its GEMM then runs inside the DP ring, not in the AR tail).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ...runtime import OverlapContext, group_info, names_operator, wgrad
from ...runtime.handlers import chunk_bounds
from ...runtime.numerics import add_wgrad, wgrad_result, wgrad_target
from ...runtime.accumulate import linear_into, weight_grad
from ..all_reduce.all_reduce import all_reduce
from ..all_reduce.select import is_decode_shaped
from ..checks import checked_context
from ..registry import RETURNED, OpPlan, WgradRoute, plain, plan_of, resolve
from .ar_matmul import DEFAULT_CHUNKS, OP

_REFERENCE = OpPlan("reference")


def _decode_branch(x, plan: OpPlan) -> bool:
    """A decode step under a fused algo (x decode-shaped [1, b, k/P], or plan.decode_step: the caller's word for
    any layout), unless the plan turned the choice off. Basis: one token per sequence has no rank blocks worth
    decomposing (a few rows padded to P, many small hops); all_reduce("auto") follows the measured table."""
    return plan.decode_all_reduce is not None and plan.algo != "reference" and (plan.decode_step or
                                                                                 is_decode_shaped(x))


def runs_stock_collective(x, plan: OpPlan) -> bool:
    """matmul_all_reduce's forward on x runs stock's all-reduce and no walk of ours: the reference plan, or the
    decode branch with the reference all-reduce (a caller then has no P2P peers to check)."""
    stock_decode = _decode_branch(x, plan) and plan.decode_all_reduce == "reference"
    return plan.algo == "reference" or stock_decode


def _decode_all_reduce(y, group, plan: OpPlan, octx):
    """y [s, b, h] of a decode step -> AR(y), summed as [1, s * b, h] (one token per row: the decode layout
    all_reduce("auto") and its calibration key on; the same bytes whatever the engine's layout)."""
    flat = y.reshape(1, -1, y.shape[-1])
    return all_reduce(flat, group, algo=plan.decode_all_reduce, context=octx).view(y.shape)


def _padded(x, world: int):
    """x [s, b, k] -> x_pad [s', b, k], s' = s rounded up to a multiple of P, the extra rows zero (x itself
    where s divides). A zero row's GEMM is a zero row and adds nothing to any other row's sum."""
    pad = -x.shape[0] % world
    if not pad:
        return x
    out = x.new_zeros((x.shape[0] + pad,) + tuple(x.shape[1:]))
    out[:x.shape[0]].copy_(x)
    return out


def ar_matmul_forward(x, weight, group, ctx, plan, tail=None):
    """The plain function of plan.algo on x [s, b, k/P] -> y [s, b, h]. Any s: where P does not divide s, the
    decomposed algorithms run on x zero-padded to the next multiple of P and y is their first s rows (the
    padded rows' all-reduce moves at most P-1 extra rows; every real row's sum is the unpadded one)."""
    world = group_info(group)[1]
    if plan.algo == "reference" or x.shape[0] % world == 0:
        return plain(OP, plan.algo)(x, weight, group, ctx, plan, tail)
    return plain(OP, plan.algo)(_padded(x, world), weight, group, ctx, plan, tail)[:x.shape[0]]


def column_nosp_backward(dy, x, weight, group, ctx, plan, dw):
    """-> (dx [s, b, h] = AR(dy @ w), dW [n/P, h] = dy^T x, or None when not wanted (dw None) or added into
    dw.into); the wgrad fills the all-reduce tail (with dw.fn: dW = dw.fn(dy, x) after it)."""
    dy = dy.contiguous()
    if dw is not None and dw.fn is not None:
        return ar_matmul_forward(dy, weight.t(), group, ctx, plan), dw.fn(dy, x)
    into = None if dw is None else dw.into
    world = group_info(group)[1]
    acc = wgrad_target(weight, into, dw is not None)
    spans = chunk_bounds(dy.shape[0], max(world - 1, 1))

    def piece(i):
        a, b = spans[i]
        add_wgrad(acc, dy[a:b], x[a:b])

    dx = ar_matmul_forward(dy, weight.t(), group, ctx, plan, (len(spans), piece) if dw is not None else None)
    return dx, wgrad_result(weight, acc, into)


def _weight_grad(weight, dW, dw, dtype):
    """The weight's autograd gradient: dW, or Megatron's dummy once dW went into dw.into."""
    return weight_grad(weight, dw.into, dtype) if dw is not None and dw.into is not None else dW


def _local_wgrad(dy, x, weight, into):
    """The row backward's local dW = dy^T x (dy is replicated): returned, or added into `into`."""
    if into is None:
        return wgrad(dy, x).to(weight.dtype)
    add_wgrad(into, dy, x)
    return None


@names_operator
class MatmulAllReduce(torch.autograd.Function):
    """Row-parallel without SP: forward y = AR(x w^T); backward local (dy is replicated)."""

    @staticmethod
    def forward(ctx, x, weight, plan, route, group, octx):
        ctx.save_for_backward(x, weight)
        ctx.route = route
        if _decode_branch(x, plan):
            return _decode_all_reduce(F.linear(x, weight), group, plan, octx)
        return ar_matmul_forward(x, weight, group, octx, plan)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dw = ctx.route if ctx.needs_input_grad[1] else None
        dx = F.linear(dy, weight.t()) if ctx.needs_input_grad[0] else None
        if dw is not None and dw.fn is not None:
            return dx, dw.fn(dy, x), None, None, None, None
        dW = _local_wgrad(dy, x, weight, dw.into) if dw is not None else None
        return dx, _weight_grad(weight, dW, dw, x.dtype), None, None, None, None


@names_operator
class MatmulAllReduceDgrad(torch.autograd.Function):
    """Column-parallel without SP: forward local y = x w^T + b; backward dx = AR(dy w), the dual."""

    @staticmethod
    def forward(ctx, x, weight, bias, plan, route, group, octx):
        ctx.save_for_backward(x, weight)
        ctx.plan, ctx.route, ctx.group, ctx.octx, ctx.has_bias = plan, route, group, octx, bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dw = ctx.route if ctx.needs_input_grad[1] else None
        dx, dW = column_nosp_backward(dy, x, weight, ctx.group, ctx.octx, ctx.plan, dw)
        db = dy.sum(dim=tuple(range(dy.dim() - 1))) if ctx.has_bias and ctx.needs_input_grad[2] else None
        if dw is None or dw.fn is None:
            dW = _weight_grad(weight, dW, dw, x.dtype)
        return dx, dW, db, None, None, None, None


def matmul_all_reduce(x: torch.Tensor, weight: torch.Tensor, group=None, *, algo: str | None = None,
                      plan: OpPlan | None = None, wgrad: WgradRoute | None = None,
                      context: OverlapContext | None = None) -> torch.Tensor:
    """y [s, b, h] = AR(x [s, b, k/P] @ weight[h, k/P]^T), replicated, with autograd (row-parallel, no SP).

    plan.num_chunks: sequence chunks C (flash: the exposed tail is 1/C of an all-gather; slicing: chunks).
    plan.decode_all_reduce: the all_reduce algo for decode-shaped x [1, b, k/P], or any x under plan.decode_step
    (module docstring); None = off.
    wgrad: where dW goes (module docstring; default: returned)."""
    route = RETURNED if wgrad is None else wgrad
    plan = resolve("matmul_all_reduce", plan_of("matmul_all_reduce", algo, plan), default_chunks=DEFAULT_CHUNKS)
    ctx = checked_context("matmul_all_reduce", x, weight, None, group, context, route)
    if ctx is None:
        return linear_into(x, weight, None, route.into, route.fn)
    return MatmulAllReduce.apply(x, weight, plan, route, group, ctx)


def matmul_allreduce_dgrad(x: torch.Tensor, weight: torch.Tensor, group=None, *, bias: torch.Tensor | None = None,
                           algo: str | None = None, plan: OpPlan | None = None, wgrad: WgradRoute | None = None,
                           context: OverlapContext | None = None) -> torch.Tensor:
    """y [s, b, n/P] = x [s, b, h] @ weight[n/P, h]^T (+ bias), whose input gradient is all-reduced over
    `group` with the decomposed all-reduce (column-parallel, no SP: Megatron's `allreduce_dgrad`).
    algo / plan / wgrad: as matmul_all_reduce's (module docstring)."""
    route = RETURNED if wgrad is None else wgrad
    plan = resolve("matmul_allreduce_dgrad", plan_of("matmul_allreduce_dgrad", algo, plan),
                   default_chunks=DEFAULT_CHUNKS)
    ctx = checked_context("matmul_allreduce_dgrad", x, weight, bias, group, context, route)
    if ctx is None:
        return linear_into(x, weight, bias, route.into, route.fn)
    return MatmulAllReduceDgrad.apply(x, weight, bias, plan, route, group, ctx)
