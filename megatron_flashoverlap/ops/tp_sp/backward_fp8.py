"""Backward passes of the two FP8 operators, each the dual of its forward, every GEMM slice one torch._scaled_mm.

Column (forward AG + GEMM), given dyq [s, b, n/P] (cast once per call from its own amax: dy is not gathered),
xq_shard [s/P, b, h], wq [n/P, h] (fp8, saved by the forward; their scales with them):
    dx [s/P, b, h] = RS(dyq @ wq)      the row forward's reduce-scatter (matmul_rs_fp8.py) of dyq and wq^T:
                                       partials written in fp32, sent in plan.wire_dtype, own block last
    dw [n/P, h] = AG(xq)^T @ dyq       one scaled GEMM per arrived slice of x's FP8 bytes (the forward's
                                       gather again, uint8 on the wire), summed in fp32 (or into dw.into)
  flash: both in ONE walk, as the bf16 backward (backward.py): dgrad RS tag 0, wgrad AG tag 1.
  reference / slicing: the stock (or chunked) reduce-scatter of the scaled-GEMM partials; dW one scaled GEMM
  on AG(xq), kept from the forward or gathered with the stock collective.
Row (forward GEMM + RS), given dyq [s/P, b, h] (cast once per call with one scale for the group: dy is
gathered), xq [s, b, k/P], wq [h, k/P]:
    dx [s, b, k/P] = AG(dyq) @ wq      the column forward's gather (ag_matmul_fp8.py) of dyq's FP8 bytes, one
                                       scaled GEMM per arrived slice straight into its rows of dx
    dw [h, k/P] = AG(dyq)^T @ xq       one scaled GEMM per arrived dy slice, summed in fp32
  flash: one Flash-AG of dy's bytes; each arrived slice gives its dx rows and adds its dW slice.
  reference / slicing: the stock (or chunked) all-gather of dy's bytes, then the two scaled GEMMs whole.
cuBLASLt's FP8 GEMM wants both operands K-major (runtime/scaled_mm.py). The dgrads' K is the weight's rows: the
weight is transposed once per call (`transposed`). The wgrads' K is the tokens: the operand held whole is
transposed once per call (each slice a column range of it), each arriving slice once as it arrives (a copy of
its FP8 bytes). So a wgrad slice's tokens (rows * b) must be a multiple of 16 (ops/checks.py refuses the call
first).
Plain functions, one per algorithm, registered as "all_gather_matmul.fp8.backward"
(dyq, xq_shard, gathered, wq, group, ctx, plan, dw) and "matmul_reduce_scatter.fp8.backward"
(dyq, xq, wq, group, ctx, plan, dw), both -> (dx, dW or None); dw as backward.py's, without dw.fn.
"""
from __future__ import annotations

import math

import torch

from ...runtime import gather, gather_and_consume, group_info, walk
from ...runtime.fp8 import Quantized
from ...runtime.numerics import flat, wgrad_result
from ...runtime.scaled_mm import column_major, fp8_rows_writer, scaled_mm, transposed
from ..registry import keeping, plain, register, ring_of
from . import ag_matmul_fp8
from .ag_matmul import gathered_output
from .ag_matmul_fp8 import gather_fp8_reference, wire
from .matmul_rs_fp8 import rs_matmul_fp8_reference, rs_matmul_fp8_slicing, scatter_fp8

COLUMN, ROW = "all_gather_matmul.fp8.backward", "matmul_reduce_scatter.fp8.backward"
F32 = torch.float32


def wgrad_adder(held: Quantized, arriving_inv: torch.Tensor, into: torch.Tensor, held_is_dy: bool = True):
    """-> add(span, rows fp8 [r, b, c]): into [n, h] += dy[span]^T @ x[span] dequantized, in fp32, where `held`
    is dy [s, b, n] (the rows are x's) or x [s, b, h] (held_is_dy=False: the rows are dy's)."""
    held_t = flat(held.data).t().contiguous()  # [c, s * b]: K-major, transposed once per call
    per = math.prod(held.data.shape[1:-1])

    def add(span, rows: torch.Tensor) -> None:
        part = held_t[:, span[0] * per:span[1] * per]  # [c, r * b]: dy^T row-major, or x^T (x column-major)
        if held_is_dy:
            into.add_(scaled_mm(part, column_major(flat(rows)), held.scale_inv, arriving_inv, F32))
        else:
            into.add_(scaled_mm(flat(rows).t().contiguous(), part.t(), arriving_inv, held.scale_inv, F32))
    return add


def dw_buffer(wq: Quantized, into: torch.Tensor | None) -> torch.Tensor:
    """Where dW is summed: the caller's `into` (e.g. Megatron's main_grad), else fresh fp32 zeros."""
    return into if into is not None else torch.zeros(wq.data.shape, dtype=F32, device=wq.data.device)


def whole_dw(dyq: Quantized, xq: Quantized, wq: Quantized, dw):
    """The unfused wgrad: one scaled GEMM dyq [s, b, n]^T @ xq [s, b, h], where `dw` routes it (None: not
    wanted)."""
    if dw is None:
        return None
    acc = dw_buffer(wq, dw.into)
    wgrad_adder(dyq, xq.scale_inv, acc)((0, xq.data.shape[0]), xq.data)
    return wgrad_result(wq, acc, dw.into)


def _column_dw(dyq, xq, gathered, wq, group, ctx, dw):
    """dW of the unfused column backward from AG(xq), kept from the forward or gathered again."""
    if dw is None:
        return None
    return whole_dw(dyq, gathered if gathered is not None else gather_fp8_reference(xq, group, ctx), wq, dw)


@register(COLUMN, "reference")
def column_fp8_backward_reference(dyq, xq, gathered, wq, group, ctx, plan, dw):
    """-> (dx [s/P, b, h], dW [n/P, h] or None): stock RS of the one scaled-GEMM partial; dW on AG(xq)."""
    dx = rs_matmul_fp8_reference(dyq, transposed(wq), group, ctx, plan)
    return dx, _column_dw(dyq, xq, gathered, wq, group, ctx, dw)


@register(COLUMN, "slicing")
def column_fp8_backward_slicing(dyq, xq, gathered, wq, group, ctx, plan, dw):
    dx = rs_matmul_fp8_slicing(dyq, transposed(wq), group, ctx, plan)
    return dx, _column_dw(dyq, xq, gathered, wq, group, ctx, dw)


@register(COLUMN, "flash")
@register(COLUMN, "flash_bidir")
def column_fp8_backward_ring(dyq, xq, gathered, wq, group, ctx, plan, dw):
    """The dgrad RS and the wgrad AG of xq's bytes in ONE walk; from a kept AG(xq) only the RS rides the ring."""
    rs = scatter_fp8(dyq, transposed(wq), group, ctx, plan, ring_of(plan, "bwd.rs", tag=0))
    if gathered is not None or dw is None:
        walk(group, ctx, rs)
        return rs.handler.result(), _column_dw(dyq, xq, gathered, wq, group, ctx, dw)
    acc = dw_buffer(wq, dw.into)
    add, fp8 = wgrad_adder(dyq, xq.scale_inv, acc), xq.data.dtype
    ag = gather(wire(xq), lambda span, rows: add(span, rows.view(fp8)), group, ctx, ring_of(plan, "bwd.ag", tag=1))
    walk(group, ctx, rs, ag)
    return rs.handler.result(), wgrad_result(wq, acc, dw.into)


@register(ROW, "reference")
@register(ROW, "slicing")
def row_fp8_backward_unfused(dyq, xq, wq, group, ctx, plan, dw):
    """-> (dx [s, b, k/P], dW [h, k/P] or None): the forward gather of the same algo (stock, or chunked) on dy's
    bytes with its scaled GEMMs for dx, AG(dyq) kept, then dW one scaled GEMM on it."""
    dx, full = plain(ag_matmul_fp8.OP, plan.algo)(dyq, transposed(wq), None, group, ctx, keeping(plan))
    return dx, whole_dw(full, xq, wq, dw)  # full: AG(dyq) [s, b, h]


@register(ROW, "flash")
@register(ROW, "flash_bidir")
def row_fp8_backward_ring(dyq, xq, wq, group, ctx, plan, dw):
    """One Flash-AG of dy's bytes; each arrived slice writes its dx rows and adds its dW slice (or into dw.into)."""
    dx = gathered_output(dyq.data, xq.data.shape[-1], group_info(group)[1], dyq.dtype)  # [s, b, k/P]
    write, fp8 = fp8_rows_writer(dx, transposed(wq), dyq.scale_inv), dyq.data.dtype
    acc = None if dw is None else dw_buffer(wq, dw.into)
    add = None if acc is None else wgrad_adder(xq, dyq.scale_inv, acc, held_is_dy=False)

    def consume(span, raw):
        rows = raw.view(fp8)  # [r, b, h]
        write(span, rows)  # dx[span] = rows @ wq, straight into dx's rows
        if add is not None:
            add(span, rows)  # dW += rows^T @ xq[span]
    gather_and_consume(wire(dyq), consume, group, ctx, ring_of(plan, "bwd.ag"))
    return dx, (None if acc is None else wgrad_result(wq, acc, dw.into))
