"""All-gather + GEMM in FP8: the forward plain functions.

    xq_shard [s/P, b, h] fp8 (one scale for the group)    wq [n/P, h] fp8    bias [n/P]    y [s, b, n/P]

    forward  y = AG(xq) @ wq^T * sx^-1 * sw^-1 + bias      every GEMM slice one torch._scaled_mm, fp32
                                                            accumulation, y in x's dtype (runtime/scaled_mm.py)

The shard is cast once per call before any transfer (functions.py, runtime/fp8.py `cast`: under tensorwise its
amax is all-reduced MAX over the group first; under delayed the scale is the one the group's last update
agreed), so every rank's shard, every slice and the reference share one scale, and only the FP8 bytes travel:
a hop carries s/P * b * h bytes, half of bf16's. The scale never travels: every rank holds it already. The
bytes move as uint8 (gloo's collectives refuse fp8 dtypes; a view, no copy) and are viewed back as fp8 for
the GEMM.

One signature, (xq, wq, bias, group, ctx, plan) -> (y, AG(xq) as a Quantized if plan.keep_gathered, else
None), registered per algo: reference (the stock all-gather of the bytes, then one scaled GEMM), flash and
flash_bidir (the Flash-AG ring, one scaled GEMM per arrived slice), slicing (chunked all-gathers, one scaled
GEMM per rank block of a chunk).
"""
from __future__ import annotations

import time

import torch

from ...runtime import gather_and_consume, group_info
from ...runtime.fp8 import Quantized
from ...runtime.scaled_mm import fp8_linear, fp8_rows_writer
from ..registry import register, ring_of
from .ag_matmul import gathered_output, sliced_gather, timed_gather

OP = "all_gather_matmul.fp8"


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


@register(OP, "reference")
def ag_matmul_fp8_reference(xq, wq, bias, group, ctx, plan):
    """Unfused: the all-gather of the FP8 bytes, then one scaled GEMM. -> (y, AG(xq) or None)."""
    full = gather_fp8_reference(xq, group, ctx)
    t = time.perf_counter()
    y = fp8_linear(full, wq, bias)
    ctx.record("compute", "whole GEMM", t)
    return y, (full if plan.keep_gathered else None)


@register(OP, "flash")
@register(OP, "flash_bidir")
def ag_matmul_fp8_ring(xq, wq, bias, group, ctx, plan):
    """Flash-AG of the FP8 bytes; each arrived slice is one scaled GEMM straight into its rows of y."""
    y = gathered_output(xq.data, wq.data.shape[0], group_info(group)[1], xq.dtype)
    write, fp8 = fp8_rows_writer(y, wq, xq.scale_inv, bias), xq.data.dtype

    def consume(span, rows):
        write(span, rows.view(fp8))
    raw = gather_and_consume(wire(xq), consume, group, ctx, ring_of(plan, "ag"), keep_gathered=plan.keep_gathered)
    return y, unwire(xq, raw)


@register(OP, "slicing")
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
