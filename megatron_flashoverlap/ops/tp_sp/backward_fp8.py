"""Backward of the FP8 all-gather + GEMM, the dual of its forward, every GEMM slice one torch._scaled_mm.

Given dyq [s, b, n/P] (fp8: e5m2 under "hybrid", cast once per call), xq_shard [s/P, b, h], wq [n/P, h] (fp8,
saved by the forward; their scales with them):
    dx [s/P, b, h] = RS(dyq @ wq)      each partial a scaled GEMM written in fp32 straight into its ring slot,
                                       summed in fp32, sent in plan.wire_dtype (runtime/numerics.py): the
                                       partials stay bf16 / fp32 on the wire, own block last
    dw [n/P, h] = AG(xq)^T @ dyq       one scaled GEMM per arrived slice of x's FP8 bytes (the forward's
                                       gather again, uint8 on the wire), summed in fp32 (or into dw.into)
  flash: both in ONE walk, as the bf16 backward (backward.py): dgrad RS tag 0, wgrad AG tag 1.
  reference / slicing: the stock (or chunked) reduce-scatter of the scaled-GEMM partials; dW one scaled GEMM
  on AG(xq), kept from the forward or gathered with the stock collective.
cuBLASLt's FP8 GEMM wants both operands K-major (runtime/scaled_mm.py). The dgrad's K is n/P: dyq's rows are
K-major as they are, wq is laid out column-major once per call. The wgrad's K is the tokens: dyq is transposed
once per call ([n/P, s * b], each slice a column range of it), each x slice once as it arrives (a copy of its
FP8 bytes). So a wgrad slice's tokens (rows * b) must be a multiple of 16 (ops/checks.py refuses the call first).
Plain functions, one per algorithm, registered as "all_gather_matmul.fp8.backward":
(dyq, xq_shard, gathered, wq, group, ctx, plan, dw) -> (dx, dW or None); dw as backward.py's, without dw.fn.
"""
from __future__ import annotations

import math

import torch

from ...runtime import Producer, gather, scatter, sums, walk
from ...runtime.fp8 import Quantized
from ...runtime.numerics import flat, wgrad_result, wire_dtype
from ...runtime.scaled_mm import column_major, scaled_mm
from ..registry import register
from .ag_matmul_fp8 import gather_fp8_reference, wire
from .matmul_rs import scatter_reference, sliced_scatter

COLUMN = "all_gather_matmul.fp8.backward"
F32 = torch.float32


def dgrad_gemm(dyq: Quantized, wq: Quantized):
    """-> gemm(dy_rows [r, b, n/P] fp8, out [r, b, h] fp32 or None): dy_rows @ wq dequantized, into `out`."""
    w_col = column_major(wq.data)  # [n/P, h], K-major: laid out once per call

    def gemm(dy_rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        o2 = None if out is None else out.view(-1, out.shape[-1])
        y = scaled_mm(flat(dy_rows), w_col, dyq.scale_inv, wq.scale_inv, F32, out=o2)  # [r * b, h]
        return y.view(tuple(dy_rows.shape[:-1]) + (w_col.shape[1],))
    return gemm


def wgrad_adder(dyq: Quantized, x_scale_inv: torch.Tensor, into: torch.Tensor):
    """-> add(span, x_rows fp8 [r, b, h]): into [n/P, h] += dyq[span]^T @ x_rows dequantized, in fp32."""
    dy_t = flat(dyq.data).t().contiguous()  # [n/P, s * b]: K-major rows, transposed once per call
    per = math.prod(dyq.data.shape[1:-1])

    def add(span, x_rows: torch.Tensor) -> None:
        a = dy_t[:, span[0] * per:span[1] * per]  # [n/P, r * b], row-major with dy_t's stride
        into.add_(scaled_mm(a, column_major(flat(x_rows)), dyq.scale_inv, x_scale_inv, F32))
    return add


def dw_buffer(wq: Quantized, into: torch.Tensor | None) -> torch.Tensor:
    """Where dW [n/P, h] is summed: the caller's `into` (e.g. Megatron's main_grad), else fresh fp32 zeros."""
    return into if into is not None else torch.zeros(wq.data.shape, dtype=F32, device=wq.data.device)


def _column_dw(dyq, xq, gathered, wq, group, ctx, dw):
    """The unfused wgrad: one scaled GEMM on AG(xq) [s, b, h], kept from the forward or gathered again, where
    `dw` routes it (None: not wanted)."""
    if dw is None:
        return None
    full = gathered if gathered is not None else gather_fp8_reference(xq, group, ctx)
    acc = dw_buffer(wq, dw.into)
    wgrad_adder(dyq, full.scale_inv, acc)((0, full.data.shape[0]), full.data)
    return wgrad_result(wq, acc, dw.into)


@register(COLUMN, "reference")
def column_fp8_backward_reference(dyq, xq, gathered, wq, group, ctx, plan, dw):
    """-> (dx [s/P, b, h], dW [n/P, h] or None): stock RS of the one scaled-GEMM partial; dW on AG(xq)."""
    partial = dgrad_gemm(dyq, wq)(dyq.data).to(wire_dtype(xq.dtype, plan.wire_dtype))  # [s, b, h]
    return scatter_reference(partial, xq.dtype, group, ctx), _column_dw(dyq, xq, gathered, wq, group, ctx, dw)


@register(COLUMN, "slicing")
def column_fp8_backward_slicing(dyq, xq, gathered, wq, group, ctx, plan, dw):
    gemm = dgrad_gemm(dyq, wq)
    dx = sliced_scatter(lambda dyc, wdt: gemm(dyc).to(wdt), dyq.data, wq.data.shape[1], xq.dtype, group, ctx, plan)
    return dx, _column_dw(dyq, xq, gathered, wq, group, ctx, dw)


@register(COLUMN, "flash")
@register(COLUMN, "flash_bidir")
def column_fp8_backward_ring(dyq, xq, gathered, wq, group, ctx, plan, dw):
    """The dgrad RS and the wgrad AG of xq's bytes in ONE walk; from a kept AG(xq) only the RS rides the ring."""
    gemm = dgrad_gemm(dyq, wq)
    block = (xq.data.shape[0],) + tuple(dyq.data.shape[1:-1]) + (wq.data.shape[1],)  # [s/P, b, h]
    rs = scatter(Producer(lambda span, out: gemm(dyq.data[span[0]:span[1]], out), into=True), block,
                 sums(xq.dtype, dyq.data.device, plan.wire_dtype), group, ctx, plan.ring("bwd.rs", tag=0))
    if gathered is not None or dw is None:
        walk(group, ctx, rs)
        return rs.handler.result(), _column_dw(dyq, xq, gathered, wq, group, ctx, dw)
    acc = dw_buffer(wq, dw.into)
    add, fp8 = wgrad_adder(dyq, xq.scale_inv, acc), xq.data.dtype
    ag = gather(wire(xq), lambda span, rows: add(span, rows.view(fp8)), group, ctx, plan.ring("bwd.ag", tag=1))
    walk(group, ctx, rs, ag)
    return rs.handler.result(), wgrad_result(wq, acc, dw.into)
