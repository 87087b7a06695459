"""GEMM + reduce-scatter in FP8: the forward plain functions.

    xq [s, b, k/P] fp8 (this rank's scale)    wq [h, k/P] fp8    y [s/P, b, h]

    forward  y = RS(xq @ wq^T * sx^-1 * sw^-1)    every partial one torch._scaled_mm written in fp32 (on the
                                                  ring straight into its slot), summed in fp32, sent in
                                                  plan.wire_dtype: partials travel in bf16 / fp32, never in
                                                  FP8, own block last (runtime/numerics.py)

x and w are cast once per call (functions.py), each from this rank's own amax: x is never gathered, so no rank
needs another rank's scale. Transformer Engine does the same: its current-scaling quantizer of a row-parallel
input reduces no amax (it reduces the input's amax over the TP group for a column-parallel layer under
sequence parallelism, and the gradient's for a row-parallel one). Each rank's GEMM dequantizes its own partial
before it leaves, so partials of differently scaled shards add as plain numbers.

One signature, (xq, wq, group, ctx, plan) -> y [s/P, b, h] in xq.dtype, registered per algo: reference (one
scaled GEMM, then the stock reduce-scatter in the wire dtype), flash and flash_bidir (Flash-RS, the partial of
the block the next hop carries made by one scaled GEMM), slicing (one scaled GEMM per row chunk of every
block, its reduce-scatter in flight while the next chunk multiplies). The column backward's dgrad is the same
reduce-scatter of dy @ w: backward_fp8.py calls these with (dyq, transposed(wq)).
"""
from __future__ import annotations

import time

import torch

from ...runtime import Pass, Producer, Ring, group_info, scatter, sums, walk, wire_dtype
from ...runtime.fp8 import Quantized
from ...runtime.numerics import flat
from ...runtime.scaled_mm import scaled_mm
from ..registry import register
from .matmul_rs import scatter_reference, sliced_scatter

OP = "matmul_reduce_scatter.fp8"
F32 = torch.float32


def transposed(wq: Quantized) -> Quantized:
    """wq [m, k] as [k, m], row-major: a transpose copy of its bytes, made once per call."""
    return wq._replace(data=wq.data.t().contiguous())


def partial_gemm(aq: Quantized, wq: Quantized):
    """-> gemm(rows [r, b, k] fp8, out [r, b, m] fp32 or None): rows @ wq.data [m, k]^T dequantized, in fp32
    (into `out`). wq.data row-major, so its transpose is the K-major second operand CUDA wants."""
    wt = wq.data.t()  # [k, m], column-major

    def gemm(rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        o2 = None if out is None else out.view(-1, out.shape[-1])
        y = scaled_mm(flat(rows), wt, aq.scale_inv, wq.scale_inv, F32, out=o2)  # [r * b, m]
        return y.view(tuple(rows.shape[:-1]) + (wt.shape[1],))
    return gemm


@register(OP, "reference")
def rs_matmul_fp8_reference(xq, wq, group, ctx, plan):
    """Unfused: one scaled GEMM, its fp32 partial rounded to the wire dtype, one stock reduce-scatter."""
    t = time.perf_counter()
    partial = partial_gemm(xq, wq)(xq.data).to(wire_dtype(xq.dtype, plan.wire_dtype))  # [s, b, h]
    ctx.record("compute", "whole GEMM", t)
    return scatter_reference(partial, xq.dtype, group, ctx)


def scatter_fp8(xq: Quantized, wq: Quantized, group, ctx, plan, ring: Ring) -> Pass:
    """The Flash-RS pass of RS(xq @ wq^T): each partial one scaled GEMM written into its fp32 ring slot."""
    gemm, world = partial_gemm(xq, wq), group_info(group)[1]
    block = (xq.data.shape[0] // world,) + tuple(xq.data.shape[1:-1]) + (wq.data.shape[0],)  # [s/P, b, h]
    return scatter(Producer(lambda span, out: gemm(xq.data[span[0]:span[1]], out), into=True), block,
                   sums(xq.dtype, xq.data.device, plan.wire_dtype), group, ctx, ring)


@register(OP, "flash")
@register(OP, "flash_bidir")
def rs_matmul_fp8_ring(xq, wq, group, ctx, plan):
    """Flash-RS: the partial of the block the next hop carries, one scaled GEMM; own block last, no tail."""
    rs = scatter_fp8(xq, wq, group, ctx, plan, plan.ring("rs"))
    walk(group, ctx, rs)
    return rs.handler.result()


@register(OP, "slicing")
def rs_matmul_fp8_slicing(xq, wq, group, ctx, plan):
    """Data slicing: one scaled GEMM per row chunk of every block (matmul_rs.py sliced_scatter)."""
    gemm = partial_gemm(xq, wq)
    return sliced_scatter(lambda xc, wdt: gemm(xc).to(wdt), xq.data, wq.data.shape[0], xq.dtype, group, ctx, plan)
