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
reduce-scatter of dy @ w: backward_fp8.py calls these with (dyq, transposed(wq)) (runtime/scaled_mm.py).
"""
from __future__ import annotations

import time

from ...runtime import Pass, Ring, group_info, scatter, sums, walk, wire_dtype
from ...runtime.fp8 import Quantized
from ...runtime.scaled_mm import scaled_partial, scaled_producer
from ..registry import register, ring_of
from .matmul_rs import scatter_reference, sliced_scatter

OP = "matmul_reduce_scatter.fp8"


@register(OP, "reference")
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


@register(OP, "flash")
@register(OP, "flash_bidir")
def rs_matmul_fp8_ring(xq, wq, group, ctx, plan):
    """Flash-RS: the partial of the block the next hop carries, one scaled GEMM; own block last, no tail."""
    rs = scatter_fp8(xq, wq, group, ctx, plan, ring_of(plan, "rs"))
    walk(group, ctx, rs)
    return rs.handler.result()


@register(OP, "slicing")
def rs_matmul_fp8_slicing(xq, wq, group, ctx, plan):
    """Data slicing: one scaled GEMM per row chunk of every block (matmul_rs.py sliced_scatter)."""
    gemm = scaled_partial(xq, wq)
    return sliced_scatter(lambda xc, wdt: gemm(xc).to(wdt), xq.data, wq.data.shape[0], xq.dtype, group, ctx, plan)
