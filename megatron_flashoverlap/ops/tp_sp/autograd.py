"""Tensor parallel with sequence parallel, the autograd face: autograd.Functions whose backward calls the dual
plain function (plain.py, plain_fp8.py), and the public wrappers.

    all_gather_matmul(x_shard [s/P, b, h], weight [n/P, h], group, bias [n/P]) -> y [s, b, n/P]
        y = AG(x) @ w^T + bias              backward: dx = RS(dy @ w), dw = AG(x)^T dy, db = sum dy
    matmul_reduce_scatter(x [s, b, k/P], weight [h, k/P], group) -> y [s/P, b, h]
        y = RS(x @ w^T)                     backward: dx = AG(dy) @ w, dw = AG(dy)^T x
    all_gather_matmul_fp8(x_shard, weight, group, plan=OpPlan(fp8=...), scales) -> y [s, b, n/P]
        all_gather_matmul with every GEMM slice an FP8 _scaled_mm (plain_fp8.py)
    matmul_reduce_scatter_fp8(x, weight, group, plan=OpPlan(fp8=...), scales) -> y [s/P, b, h]
        matmul_reduce_scatter with every GEMM slice an FP8 _scaled_mm (plain_fp8.py)

algo: "flash" (decomposed ring, rank-adaptive), "flash_bidir" (the same on a bidirectional ring),
"slicing" (data slicing with `num_chunks`, the baseline), "reference" (collective, then GEMM): the shorthand
of plan=OpPlan(algo, ...), which carries the other knobs (ops/registry.py):
    num_chunks     slicing: the chunk count
    hop_chunks     flash only: row sub-chunks per hop, each its own transfer posted ahead (None: automatic,
                   1 by measurement, plain.py hop_chunks_for); forward and backward rings use the same count
    keep_gathered  all_gather_matmul: keep AG(x) from forward for the weight gradient
    wire_dtype     what reduce-scatter partials (forward RS, column dgrad RS) travel in: "input" (default,
                   stock's bytes; sums kept in fp32 and rounded per hop) or "fp32" (twice the bytes, one
                   rounding; runtime/numerics.py)
    fp8            an Fp8Recipe (runtime/fp8.py), run by all_gather_matmul_fp8 / matmul_reduce_scatter_fp8 below
`force_reference()` routes every call to "reference". A group of size 1 is a plain GEMM (an FP8 one under fp8).
wgrad=WgradRoute(...) (optional) says where dW goes:
    into [n, h] (e.g. Megatron's fp32 main_grad): dW is added into it slice by slice instead of being returned;
        the weight then gets Megatron's dummy gradient (runtime/accumulate.py: weight_grad)
    fn(dy_full, x_full) -> the weight's autograd gradient (e.g. the data-parallel reduce-scatter of dW inside
        its GEMM, megatron/ddp/grad_sync.py): backward keeps the operand it gathers and hands this rank's complete dW
        operands to it once (plain.py)
The autograd.Functions carry (tensors..., plan, route, group, context): the plan resolved once per call
(words, force_reference, hop_chunks for this shard) and saved on ctx for the backward.
"""
from __future__ import annotations

import torch

from ...runtime import OverlapContext, default_context, group_info, names_operator
from ...runtime.accumulate import linear_into, weight_grad
from ...runtime.fp8 import DelayedScales, Quantized, cast, cast_shared, save_fp8, saved_fp8
from ..checks import check_fp8_shapes, checked_context, fp8_plan
from ..registry import RETURNED, Fp8Call, OpPlan, WgradRoute, plain, plan_of, reference_plan, resolve
from .plain import AG_OP, COLUMN, ROW, RS_OP, sized
from .plain_fp8 import AG_FP8, COLUMN_FP8, ROW_FP8, RS_FP8


@names_operator
class AllGatherMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_shard, weight, bias, plan, route, group, octx):
        y, gathered = plain(AG_OP, plan.algo)(x_shard, weight, bias, group, octx, plan)
        ctx.save_for_backward(x_shard, weight, gathered)
        ctx.plan, ctx.route, ctx.group, ctx.octx = plan, route, group, octx  # route.into: not saved, an in-place
        ctx.has_bias = bias is not None                                      # target (as Megatron's main_grad)
        return y

    @staticmethod
    def backward(ctx, dy):
        x_shard, weight, gathered = ctx.saved_tensors
        dw = ctx.route if ctx.needs_input_grad[1] else None
        dx, dW = plain(COLUMN, ctx.plan.algo)(dy.contiguous(), x_shard, gathered, weight, ctx.group,
                                                       ctx.octx, ctx.plan, dw)
        if dw is not None and dw.into is not None:
            dW = weight_grad(weight, dw.into, x_shard.dtype)
        db = dy.sum(dim=tuple(range(dy.dim() - 1))) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, dW, db, None, None, None, None


@names_operator
class MatmulReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, plan, route, group, octx):
        ctx.save_for_backward(x, weight)
        ctx.plan, ctx.route, ctx.group, ctx.octx = plan, route, group, octx
        return plain(RS_OP, plan.algo)(x, weight, group, octx, plan)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dw = ctx.route if ctx.needs_input_grad[1] else None
        dx, dW = plain(ROW, ctx.plan.algo)(dy.contiguous(), x, weight, ctx.group, ctx.octx, ctx.plan, dw)
        if dw is not None and dw.into is not None:
            dW = weight_grad(weight, dw.into, x.dtype)
        return dx, dW, None, None, None, None


def all_gather_matmul(x_shard: torch.Tensor, weight: torch.Tensor, group=None, *, bias: torch.Tensor | None = None,
                      algo: str | None = None, plan: OpPlan | None = None, wgrad: WgradRoute | None = None,
                      context: OverlapContext | None = None) -> torch.Tensor:
    """y [s, b, n/P] = AG(x_shard [s/P, b, h]) @ weight[n/P, h]^T (+ bias [n/P]), with autograd.

    algo: the shorthand of plan=OpPlan(algo) (default "flash"); plan: the algorithm and its knobs, e.g.
    OpPlan("flash", keep_gathered=True), OpPlan("slicing", num_chunks=4). wgrad: where dW goes (module
    docstring; default: returned)."""
    route = RETURNED if wgrad is None else wgrad
    plan = resolve("all_gather_matmul", plan_of("all_gather_matmul", algo, plan))
    if plan.fp8 is not None:
        return all_gather_matmul_fp8(x_shard, weight, group, plan=plan, bias=bias, wgrad=wgrad, context=context)
    ctx = checked_context("all_gather_matmul", x_shard, weight, bias, group, context, route)
    if ctx is None:
        return linear_into(x_shard, weight, bias, route.into, route.fn)
    plan = sized(plan, x_shard.shape[0])
    return AllGatherMatmul.apply(x_shard, weight, bias, plan, route, group, ctx)


def matmul_reduce_scatter(x: torch.Tensor, weight: torch.Tensor, group=None, *, algo: str | None = None,
                          plan: OpPlan | None = None, wgrad: WgradRoute | None = None,
                          context: OverlapContext | None = None) -> torch.Tensor:
    """y [s/P, b, h] = RS(x [s, b, k/P] @ weight[h, k/P]^T), with autograd; partial sums kept in fp32 for
    bf16/fp16, sent in plan.wire_dtype ("input": the input dtype, stock's bytes; "fp32").
    algo / plan / wgrad: as all_gather_matmul's (module docstring)."""
    route = RETURNED if wgrad is None else wgrad
    plan = resolve("matmul_reduce_scatter", plan_of("matmul_reduce_scatter", algo, plan))
    if plan.fp8 is not None:
        return matmul_reduce_scatter_fp8(x, weight, group, plan=plan, wgrad=wgrad, context=context)
    ctx = checked_context("matmul_reduce_scatter", x, weight, None, group, context, route, divisible=True)
    if ctx is None:
        return linear_into(x, weight, None, route.into, route.fn)
    plan = sized(plan, x.shape[0] // group_info(group)[1])
    return MatmulReduceScatter.apply(x, weight, plan, route, group, ctx)


@names_operator
class Fp8AllGatherMatmul(torch.autograd.Function):
    """x and w cast once per call (x's amax agreed over the group), the FP8 forward; backward casts dy once
    (e5m2 under hybrid) and runs the FP8 dual. Saved: the FP8 bytes and their scales, not x."""

    @staticmethod
    def forward(ctx, x_shard, weight, bias, plan, call, group, octx):
        xq = cast_shared(x_shard, "input", plan.fp8, call.scales, group)
        wq = cast(weight, "weight", plan.fp8, call.scales)
        y, gathered = plain(AG_FP8, plan.algo)(xq, wq, bias, group, octx, plan)
        kept = () if gathered is None else (gathered.data,)
        ctx.save_for_backward(weight, xq.data, xq.scale_inv, wq.data, wq.scale_inv, *kept)
        ctx.plan, ctx.call, ctx.group, ctx.octx = plan, call, group, octx
        ctx.has_bias, ctx.x_dtype = bias is not None, x_shard.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        weight, x8, x_inv, w8, w_inv, *kept = ctx.saved_tensors
        xq, wq = Quantized(x8, x_inv, ctx.x_dtype), Quantized(w8, w_inv, weight.dtype)
        dyq = cast(dy.contiguous(), "grad_output", ctx.plan.fp8, ctx.call.scales)
        dw = ctx.call.route if ctx.needs_input_grad[1] else None
        dx, dW = plain(COLUMN_FP8, ctx.plan.algo)(dyq, xq, xq._replace(data=kept[0]) if kept else None,
                                                           wq, ctx.group, ctx.octx, ctx.plan, dw)
        if dw is not None and dw.into is not None:
            dW = weight_grad(weight, dw.into, ctx.x_dtype)
        db = dy.sum(dim=tuple(range(dy.dim() - 1))) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, dW, db, None, None, None, None


def _fp8_sized(op: str, x, weight, group, plan: OpPlan, ctx, rows: int) -> OpPlan:
    """The plan sized for a shard of `rows` rows (a group of one, ctx None: the reference, one FP8 GEMM), then
    CUDA's FP8 rules on the shapes it will multiply (ops/checks.py check_fp8_shapes), before any transfer."""
    plan = sized(plan, rows) if ctx is not None else reference_plan(plan)
    check_fp8_shapes(op, x, weight, rows, group_info(group)[1], plan,
                     torch.is_grad_enabled() and weight.requires_grad)  # inference takes no dW
    return plan


def all_gather_matmul_fp8(x_shard: torch.Tensor, weight: torch.Tensor, group=None, *, plan: OpPlan,
                          bias: torch.Tensor | None = None, scales: DelayedScales | None = None,
                          wgrad: WgradRoute | None = None, context: OverlapContext | None = None) -> torch.Tensor:
    """y [s, b, n/P] = AG(x_shard [s/P, b, h]) @ weight[n/P, h]^T (+ bias [n/P]), every GEMM slice in FP8
    (forward, dgrad, wgrad), with autograd. plan.fp8: the recipe; scales: its DelayedScales under 'delayed'
    (the caller keeps one per layer and calls scales.update(group) after each step). A group of size 1 runs
    the reference (one FP8 GEMM). Shapes CUDA cannot run in FP8 are refused (ops/checks.py), never run in bf16."""
    call = Fp8Call(RETURNED if wgrad is None else wgrad, scales)
    plan = fp8_plan("all_gather_matmul", plan, call)
    ctx = checked_context("all_gather_matmul", x_shard, weight, bias, group, context, call.route)
    plan = _fp8_sized("all_gather_matmul", x_shard, weight, group, plan, ctx, x_shard.shape[0])
    return Fp8AllGatherMatmul.apply(x_shard, weight, bias, plan, call, group, ctx or context or default_context())


@names_operator
class Fp8MatmulReduceScatter(torch.autograd.Function):
    """x and w cast once per call, each from this rank's own amax (x is not gathered: plain_fp8.py), the FP8
    forward; backward casts dy once with one scale for the group (its amax reduced MAX: dy is gathered; e5m2
    under hybrid) and runs the FP8 dual. Saved: the FP8 bytes and their scales, not x."""

    @staticmethod
    def forward(ctx, x, weight, plan, call, group, octx):
        xq, wq = save_fp8(ctx, x, weight, plan, call, group, octx)
        return plain(RS_FP8, plan.algo)(xq, wq, group, octx, plan)

    @staticmethod
    def backward(ctx, dy):
        weight, xq, wq = saved_fp8(ctx)
        dyq = cast_shared(dy.contiguous(), "grad_output", ctx.plan.fp8, ctx.call.scales, ctx.group)
        dw = ctx.call.route if ctx.needs_input_grad[1] else None
        dx, dW = plain(ROW_FP8, ctx.plan.algo)(dyq, xq, wq, ctx.group, ctx.octx, ctx.plan, dw)
        if dw is not None and dw.into is not None:
            dW = weight_grad(weight, dw.into, ctx.x_dtype)
        return dx, dW, None, None, None, None


def matmul_reduce_scatter_fp8(x: torch.Tensor, weight: torch.Tensor, group=None, *, plan: OpPlan,
                              scales: DelayedScales | None = None, wgrad: WgradRoute | None = None,
                              context: OverlapContext | None = None) -> torch.Tensor:
    """y [s/P, b, h] = RS(x [s, b, k/P] @ weight[h, k/P]^T), every GEMM slice in FP8 (forward, dgrad, wgrad), the
    partials on the reduce-scatter wire in plan.wire_dtype (never FP8), with autograd. plan.fp8, scales: as
    all_gather_matmul_fp8's. A group of size 1 runs the reference (one FP8 GEMM). Shapes CUDA cannot run in FP8
    are refused (ops/checks.py), never run in bf16."""
    call = Fp8Call(RETURNED if wgrad is None else wgrad, scales)
    plan = fp8_plan("matmul_reduce_scatter", plan, call)
    ctx = checked_context("matmul_reduce_scatter", x, weight, None, group, context, call.route, divisible=True)
    plan = _fp8_sized("matmul_reduce_scatter", x, weight, group, plan, ctx, x.shape[0] // group_info(group)[1])
    return Fp8MatmulReduceScatter.apply(x, weight, plan, call, group, ctx or context or default_context())
