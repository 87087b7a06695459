"""Tensor parallel without sequence parallel, the autograd face: the autograd.Functions and the public wrappers.

    matmul_all_reduce(x_k [s, b, k/P], weight_k [h, k/P], group) -> y [s, b, h]  (row-parallel, replicated)
        forward y = AR(x @ w^T)         backward dx = dy @ w, dw = dy^T x (local: dy is replicated)
    matmul_allreduce_dgrad(x [s, b, h], weight_n [n/P, h], group, bias) -> y_n [s, b, n/P]  (column-parallel)
        forward y = x @ w^T + bias      backward dx = AR(dy @ w) with the wgrad filling its tail, dw, db
    matmul_all_reduce_fp8, matmul_allreduce_dgrad_fp8(..., plan=OpPlan(fp8=...), scales)
        the same with every GEMM (slice) an FP8 _scaled_mm (plain_fp8.py): x, w and dy each cast once per
        call from this rank's own amax (none is gathered); the all-reduce carries bf16 / fp32 partials

The decomposition and the plain functions: plain.py (FP8: plain_fp8.py). Decode (x [1, b, k/P], one new token per
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
reduce-scatter partials travel in, "input" (default, stock's bytes) or "fp32", plain.py; the decode
all-reduce always runs in the input dtype), decode_all_reduce (matmul_all_reduce).
wgrad=WgradRoute(into=...) [weight's shape] (e.g. Megatron's fp32 main_grad): dw is added into it (slice by
slice in the column backward's all-reduce tail) instead of being returned; the weight then gets Megatron's
dummy gradient (runtime/accumulate.py: weight_grad). WgradRoute(fn=...): fn(dy, x) -> the weight's autograd
gradient (e.g. the data-parallel reduce-scatter of dW, megatron/ddp/grad_sync.py): gets this rank's complete dW
operands once, after the all-reduce (its GEMM then runs inside the DP ring, not in the AR tail).
FP8 (plan.fp8, or the *_fp8 wrappers): the decode branch and the padding run as above on the FP8 GEMMs;
the column backward's wgrad tail is cut at multiples of 16 tokens (CUDA's K rule); wgrad fn is refused.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ...runtime import OverlapContext, default_context, group_info, names_operator, wgrad
from ...runtime.fp8 import DelayedScales, Quantized, cast, save_fp8, saved_fp8
from ...runtime.handlers import chunk_bounds
from ...runtime.numerics import add_wgrad, wgrad_result, wgrad_target
from ...runtime.accumulate import linear_into, weight_grad
from ...runtime.scaled_mm import dw_buffer, fp8_linear, transposed, wgrad_adder, whole_dw
from ..all_reduce.all_reduce import all_reduce
from ..all_reduce.select import is_decode_shaped
from ..checks import check_fp8_shapes, checked_context, fp8_plan
from ..registry import RETURNED, Fp8Call, OpPlan, WgradRoute, plain, plan_of, reference_plan, resolve
from .plain import DEFAULT_CHUNKS, OP
from .plain_fp8 import OP_FP8

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
    where s divides). A zero row's GEMM is a zero row and adds nothing to any other row's sum. A Quantized x:
    its bytes padded (a zero byte is +0 in both FP8 formats)."""
    if isinstance(x, Quantized):
        return x._replace(data=_padded(x.data, world))
    pad = -x.shape[0] % world
    if not pad:
        return x
    out = x.new_zeros((x.shape[0] + pad,) + tuple(x.shape[1:]))
    out[:x.shape[0]].copy_(x)
    return out


def ar_matmul_forward(x, weight, group, ctx, plan, tail=None):
    """The plain function of plan.algo on x [s, b, k/P] -> y [s, b, h]. Any s: where P does not divide s, the
    decomposed algorithms run on x zero-padded to the next multiple of P and y is their first s rows (the
    padded rows' all-reduce moves at most P-1 extra rows; every real row's sum is the unpadded one). Under
    plan.fp8, x and weight are Quantized, run by plain_fp8.py's functions."""
    world, rows = group_info(group)[1], (x.data if isinstance(x, Quantized) else x).shape[0]
    fn = plain(OP if plan.fp8 is None else OP_FP8, plan.algo)
    if plan.algo == "reference" or rows % world == 0:
        return fn(x, weight, group, ctx, plan, tail)
    return fn(_padded(x, world), weight, group, ctx, plan, tail)[:rows]


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
    if plan.fp8 is not None:
        return matmul_all_reduce_fp8(x, weight, group, plan=plan, wgrad=wgrad, context=context)
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
    if plan.fp8 is not None:
        return matmul_allreduce_dgrad_fp8(x, weight, group, plan=plan, bias=bias, wgrad=wgrad, context=context)
    ctx = checked_context("matmul_allreduce_dgrad", x, weight, bias, group, context, route)
    if ctx is None:
        return linear_into(x, weight, bias, route.into, route.fn)
    return MatmulAllReduceDgrad.apply(x, weight, bias, plan, route, group, ctx)


# ---------------------------------------------------------------- FP8 (plan.fp8)

def wgrad_spans(rows: int, batch: int, pieces: int) -> list[tuple[int, int]]:
    """Row spans of the FP8 wgrad tail: up to `pieces` spans, each a whole number of 16-token granules (rows *
    batch a multiple of 16, checked first: ops/checks.py), so every piece is a GEMM CUDA runs."""
    g = 16 // math.gcd(16, batch)  # rows per granule
    return [(a * g, b * g) for a, b in chunk_bounds(rows // g, max(1, min(pieces, rows // g)))]


def column_nosp_fp8_backward(dyq, xq, wq, group, ctx, plan, dw):
    """-> (dx [s, b, h] = AR(dyq @ wq), dW [n/P, h] = dyq^T xq, or None when not wanted or added into dw.into):
    each partial a scaled GEMM; the wgrad's scaled GEMMs fill the all-reduce's tail."""
    if dw is None:
        return ar_matmul_forward(dyq, transposed(wq), group, ctx, plan), None
    acc = dw_buffer(wq, dw.into)
    add = wgrad_adder(dyq, xq.scale_inv, acc)
    spans = wgrad_spans(dyq.data.shape[0], math.prod(dyq.data.shape[1:-1]), max(group_info(group)[1] - 1, 1))

    def piece(i):
        a, b = spans[i]
        add((a, b), xq.data[a:b])  # dW += dyq[a:b]^T xq[a:b]
    dx = ar_matmul_forward(dyq, transposed(wq), group, ctx, plan, (len(spans), piece))
    return dx, wgrad_result(wq, acc, dw.into)


@names_operator
class Fp8MatmulAllReduce(torch.autograd.Function):
    """Row-parallel without SP in FP8: forward y = AR of scaled partials; backward local (dy is replicated):
    dy cast once from its own amax (the same on every rank), dx and dW one scaled GEMM each."""

    @staticmethod
    def forward(ctx, x, weight, plan, call, group, octx):
        xq, wq = save_fp8(ctx, x, weight, plan, call, group, octx)
        if _decode_branch(x, plan):
            return _decode_all_reduce(fp8_linear(xq, wq), group, plan, octx)
        return ar_matmul_forward(xq, wq, group, octx, plan)

    @staticmethod
    def backward(ctx, dy):
        weight, xq, wq = saved_fp8(ctx)
        dyq = cast(dy.contiguous(), "grad_output", ctx.plan.fp8, ctx.call.scales)
        dw = ctx.call.route if ctx.needs_input_grad[1] else None
        dx = fp8_linear(dyq, transposed(wq)) if ctx.needs_input_grad[0] else None  # [s, b, k/P]
        return dx, _weight_grad(weight, whole_dw(dyq, xq, wq, dw), dw, ctx.x_dtype), None, None, None, None


@names_operator
class Fp8MatmulAllReduceDgrad(torch.autograd.Function):
    """Column-parallel without SP in FP8: forward local y = xq wq^T + b, one scaled GEMM; backward dy cast once
    from its own amax (this rank's output gradient, never gathered), dx = AR of scaled partials."""

    @staticmethod
    def forward(ctx, x, weight, bias, plan, call, group, octx):
        xq, wq = save_fp8(ctx, x, weight, plan, call, group, octx)
        ctx.has_bias = bias is not None
        return fp8_linear(xq, wq, bias)

    @staticmethod
    def backward(ctx, dy):
        weight, xq, wq = saved_fp8(ctx)
        dyq = cast(dy.contiguous(), "grad_output", ctx.plan.fp8, ctx.call.scales)
        dw = ctx.call.route if ctx.needs_input_grad[1] else None
        dx, dW = column_nosp_fp8_backward(dyq, xq, wq, ctx.group, ctx.octx, ctx.plan, dw)
        db = dy.sum(dim=tuple(range(dy.dim() - 1))) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, _weight_grad(weight, dW, dw, ctx.x_dtype), db, None, None, None, None


def _fp8_checked(op: str, x, weight, bias, group, plan: OpPlan, call: Fp8Call, context):
    """The checks of an FP8 call before any transfer (ops/checks.py) -> (the plan it runs: the reference in a
    group of one, the context)."""
    plan = fp8_plan(op, plan, call, DEFAULT_CHUNKS)
    ctx = checked_context(op, x, weight, bias, group, context, call.route)
    check_fp8_shapes(op, x, weight, x.shape[0], group_info(group)[1], plan,
                     torch.is_grad_enabled() and weight.requires_grad)  # inference takes no dW
    return (plan, ctx) if ctx is not None else (reference_plan(plan), context or default_context())


def matmul_all_reduce_fp8(x: torch.Tensor, weight: torch.Tensor, group=None, *, plan: OpPlan,
                          scales: DelayedScales | None = None, wgrad: WgradRoute | None = None,
                          context: OverlapContext | None = None) -> torch.Tensor:
    """matmul_all_reduce with every GEMM (slice) in FP8, forward and backward, with autograd. plan.fp8: the
    recipe; scales: its DelayedScales under 'delayed' (tp_sp/autograd.py all_gather_matmul_fp8). Shapes CUDA
    cannot run in FP8 are refused (ops/checks.py), never run in bf16."""
    call = Fp8Call(RETURNED if wgrad is None else wgrad, scales)
    plan, ctx = _fp8_checked("matmul_all_reduce", x, weight, None, group, plan, call, context)
    return Fp8MatmulAllReduce.apply(x, weight, plan, call, group, ctx)


def matmul_allreduce_dgrad_fp8(x: torch.Tensor, weight: torch.Tensor, group=None, *, plan: OpPlan,
                               bias: torch.Tensor | None = None, scales: DelayedScales | None = None,
                               wgrad: WgradRoute | None = None, context: OverlapContext | None = None) -> torch.Tensor:
    """matmul_allreduce_dgrad with every GEMM (slice) in FP8; as matmul_all_reduce_fp8."""
    call = Fp8Call(RETURNED if wgrad is None else wgrad, scales)
    plan, ctx = _fp8_checked("matmul_allreduce_dgrad", x, weight, bias, group, plan, call, context)
    return Fp8MatmulAllReduceDgrad.apply(x, weight, bias, plan, call, group, ctx)
