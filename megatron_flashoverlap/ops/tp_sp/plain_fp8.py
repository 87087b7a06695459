"""Tensor parallel with sequence parallel in FP8, the plain functions: plain.py's operators with every GEMM slice
one torch._scaled_mm (fp32 accumulation, the activation dtype out; runtime/scaled_mm.py), forward and backward.

    column  xq_shard [s/P, b, h] fp8 (one scale for the group)   wq [n/P, h] fp8   bias [n/P]   y [s, b, n/P]
        forward  y = AG(xq) @ wq^T * sx^-1 * sw^-1 + bias
        dgrad    dx = RS(dyq @ wq)       dyq cast from its own amax (dy is not gathered); the row forward's RS
        wgrad    dw = AG(xq)^T @ dyq     one scaled GEMM per arrived slice of x's bytes, summed in fp32
    row     xq [s, b, k/P] fp8 (this rank's scale)   wq [h, k/P] fp8   y [s/P, b, h]
        forward  y = RS(xq @ wq^T * sx^-1 * sw^-1)   partials written in fp32, sent in plan.wire_dtype
        dgrad    dx = AG(dyq) @ wq       dyq with one scale for the group (dy is gathered); the column's gather
        wgrad    dw = AG(dyq)^T @ xq     one scaled GEMM per arrived dy slice, summed in fp32

Each tensor is cast once per call before any transfer (autograd.py, runtime/fp8.py): a gathered tensor (the
column's x, the row's dy) with one scale for the group (its amax reduced MAX under tensorwise; the group's agreed
scale under delayed), so every slice, every rank and the reference share it and only the FP8 bytes travel, half
of bf16's; the scale never travels. The bytes move as uint8 (gloo refuses fp8 dtypes; a view, no copy).
A reduce-scatter's partials travel in bf16 / fp32, never FP8, own block last: each rank dequantizes its own
partial before it leaves, so shards of different scales add as plain numbers (Transformer Engine's current
scaling reduces the amax the same way: a column input's under sequence parallelism, a row's gradient).
cuBLASLt wants both operands K-major: a dgrad's weight is transposed once per call (`transposed`), a wgrad's held
operand once per call and each arriving slice as it arrives, so a wgrad slice's tokens must be a multiple of 16
(ops/checks.py refuses the call first).

Signatures as plain.py's, with Quantized operands (runtime/fp8.py): AG_FP8 (xq, wq, bias, group, ctx, plan),
RS_FP8 (xq, wq, group, ctx, plan), COLUMN_FP8 (dyq, xq_shard, gathered, wq, group, ctx, plan, dw), ROW_FP8 (dyq,
xq, wq, group, ctx, plan, dw); dw as plain.py's, without dw.fn.
"""
from __future__ import annotations

import time

import torch

from ...runtime import Pass, Ring, gather, gather_and_consume, group_info, scatter, sums, walk, wire_dtype
from ...runtime.fp8 import Quantized
from ...runtime.numerics import wgrad_result
from ...runtime.scaled_mm import (dw_buffer, fp8_linear, fp8_rows_writer, scaled_partial, scaled_producer,
                                  transposed, wgrad_adder, whole_dw)
from ..registry import keeping, plain, register, ring_of
from .plain import (gathered_output, scatter_reference, sliced_gather, sliced_scatter, stock_column_backward,
                    timed_gather)

AG_FP8, RS_FP8 = "all_gather_matmul.fp8", "matmul_reduce_scatter.fp8"
COLUMN_FP8, ROW_FP8 = f"{AG_FP8}.backward", f"{RS_FP8}.backward"


def wire(q: Quantized) -> torch.Tensor:
    """The bytes of q.data as uint8 (a view): what the gather moves."""
    return q.data.view(torch.uint8)


def unwire(q: Quantized, raw: torch.Tensor | None) -> Quantized | None:
    """Gathered uint8 bytes back as a Quantized of q's format and scale (None stays None)."""
    return None if raw is None else q._replace(data=raw.view(q.data.dtype))


def gather_fp8_reference(xq: Quantized, group, ctx) -> Quantized:
    """The stock all-gather of xq's bytes along dim 0: [s/P, ...] -> [s, ...] (xq itself in a group of one)."""
    if group_info(group)[1] == 1:
        return xq
    return unwire(xq, timed_gather(wire(xq), group, ctx))


@register(AG_FP8, "reference")
def ag_matmul_fp8_reference(xq, wq, bias, group, ctx, plan):
    """Unfused: the all-gather of the FP8 bytes, then one scaled GEMM. -> (y, AG(xq) or None)."""
    full = gather_fp8_reference(xq, group, ctx)
    t = time.perf_counter()
    y = fp8_linear(full, wq, bias)
    ctx.record("compute", "whole GEMM", t)
    return y, (full if plan.keep_gathered else None)


@register(AG_FP8, "flash")
@register(AG_FP8, "flash_bidir")
def ag_matmul_fp8_ring(xq, wq, bias, group, ctx, plan):
    """Flash-AG of the FP8 bytes; each arrived slice is one scaled GEMM straight into its rows of y."""
    y = gathered_output(xq.data, wq.data.shape[0], group_info(group)[1], xq.dtype)
    write, fp8 = fp8_rows_writer(y, wq, xq.scale_inv, bias), xq.data.dtype

    def consume(span, rows):
        write(span, rows.view(fp8))
    raw = gather_and_consume(wire(xq), consume, group, ctx, ring_of(plan, "ag"), keep_gathered=plan.keep_gathered)
    return y, unwire(xq, raw)


@register(AG_FP8, "slicing")
def ag_matmul_fp8_slicing(xq, wq, bias, group, ctx, plan):
    """Data slicing of the FP8 bytes: chunk j+1.. gathers while chunk j multiplies, one scaled GEMM per rank
    block of the chunk (a block's rows are contiguous in y; the chunk's P blocks are not)."""
    world, rows = group_info(group)[1], xq.data.shape[0]
    y = gathered_output(xq.data, wq.data.shape[0], world, xq.dtype)
    write, fp8 = fp8_rows_writer(y, wq, xq.scale_inv, bias), xq.data.dtype

    def consume(a, b, buf):  # buf [P, b - a, b, h] uint8
        for p in range(world):
            write((p * rows + a, p * rows + b), buf[p].view(fp8))
    return y, unwire(xq, sliced_gather(wire(xq), consume, group, ctx, plan))


@register(RS_FP8, "reference")
def rs_matmul_fp8_reference(xq, wq, group, ctx, plan):
    """Unfused: one scaled GEMM, its fp32 partial rounded to the wire dtype, one stock reduce-scatter."""
    t = time.perf_counter()
    partial = scaled_partial(xq, wq)(xq.data).to(wire_dtype(xq.dtype, plan.wire_dtype))  # [s, b, h]
    ctx.record("compute", "whole GEMM", t)
    return scatter_reference(partial, xq.dtype, group, ctx)


def scatter_fp8(xq: Quantized, wq: Quantized, group, ctx, plan, ring: Ring) -> Pass:
    """The Flash-RS pass of RS(xq @ wq^T): each partial one scaled GEMM written into its fp32 ring slot."""
    world = group_info(group)[1]
    block = (xq.data.shape[0] // world,) + tuple(xq.data.shape[1:-1]) + (wq.data.shape[0],)  # [s/P, b, h]
    return scatter(scaled_producer(xq, wq), block, sums(xq.dtype, xq.data.device, plan.wire_dtype), group, ctx, ring)


@register(RS_FP8, "flash")
@register(RS_FP8, "flash_bidir")
def rs_matmul_fp8_ring(xq, wq, group, ctx, plan):
    """Flash-RS: the partial of the block the next hop carries, one scaled GEMM; own block last, no tail."""
    rs = scatter_fp8(xq, wq, group, ctx, plan, ring_of(plan, "rs"))
    walk(group, ctx, rs)
    return rs.handler.result()


@register(RS_FP8, "slicing")
def rs_matmul_fp8_slicing(xq, wq, group, ctx, plan):
    """Data slicing: one scaled GEMM per row chunk of every block (plain.py sliced_scatter)."""
    gemm = scaled_partial(xq, wq)
    return sliced_scatter(lambda xc, wdt: gemm(xc).to(wdt), xq.data, wq.data.shape[0], xq.dtype, group, ctx, plan)


def _column_dw(dyq, xq, gathered, wq, group, ctx, dw):
    """dW of the unfused column backward from AG(xq), kept from the forward or gathered again."""
    if dw is None:
        return None
    return whole_dw(dyq, gathered if gathered is not None else gather_fp8_reference(xq, group, ctx), wq, dw)


@register(COLUMN_FP8, "reference")
def column_fp8_backward_reference(dyq, xq, gathered, wq, group, ctx, plan, dw):
    """-> (dx [s/P, b, h], dW [n/P, h] or None): stock RS of the one scaled-GEMM partial under dW on AG(xq),
    xq's bytes re-gathered under the dgrad (plain.stock_column_backward)."""
    wt = transposed(wq)
    regather = wire(xq) if dw is not None and gathered is None else None
    return stock_column_backward(
        lambda: scaled_partial(dyq, wt)(dyq.data).to(wire_dtype(dyq.dtype, plan.wire_dtype)), regather,
        lambda raw: None if dw is None else whole_dw(dyq, unwire(xq, raw) if gathered is None else gathered, wq, dw),
        dyq.dtype, group, ctx)


@register(COLUMN_FP8, "slicing")
def column_fp8_backward_slicing(dyq, xq, gathered, wq, group, ctx, plan, dw):
    dx = rs_matmul_fp8_slicing(dyq, transposed(wq), group, ctx, plan)
    return dx, _column_dw(dyq, xq, gathered, wq, group, ctx, dw)


@register(COLUMN_FP8, "flash")
@register(COLUMN_FP8, "flash_bidir")
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


@register(ROW_FP8, "reference")
@register(ROW_FP8, "slicing")
def row_fp8_backward_unfused(dyq, xq, wq, group, ctx, plan, dw):
    """-> (dx [s, b, k/P], dW [h, k/P] or None): the forward gather of the same algo (stock, or chunked) on dy's
    bytes with its scaled GEMMs for dx, AG(dyq) kept, then dW one scaled GEMM on it."""
    dx, full = plain(AG_FP8, plan.algo)(dyq, transposed(wq), None, group, ctx, keeping(plan))
    return dx, whole_dw(full, xq, wq, dw)  # full: AG(dyq) [s, b, h]


@register(ROW_FP8, "flash")
@register(ROW_FP8, "flash_bidir")
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
