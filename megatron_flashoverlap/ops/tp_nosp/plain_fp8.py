"""GEMM + all-reduce in FP8: the plain functions (no autograd).

    xq [s, b, k/P] fp8 (this rank's scale)    wq [h, k/P] fp8    y [s, b, h]  (replicated, xq.dtype)

    y = AR(xq @ wq^T * sx^-1 * sw^-1)    every partial one torch._scaled_mm written in fp32, summed in fp32 and
                                         sent in plan.wire_dtype (bf16 / fp32, never FP8); the reduced block is
                                         rounded once to xq.dtype before the all-gather (plain.py), so every
                                         rank ends with the same bits

Neither operand is gathered, so each is cast from this rank's own amax (autograd.py): each rank's GEMM
dequantizes its partial before it leaves, and partials of differently scaled shards add as plain numbers.
Transformer Engine reduces no amax over the TP group without sequence parallelism either.

One signature, (xq, wq, group, ctx, plan, tail=None) -> y, registered per algo as "matmul_all_reduce.fp8" on the
cores of plain.py: reference (one scaled GEMM, one dist.all_reduce), slicing (one scaled GEMM per chunk, its
all-reduce in flight while the next multiplies), flash and flash_bidir (chunked Flash-RS + Flash-AG, each
partial one scaled GEMM into its fp32 ring slot). `tail`: as plain.py's. The column operator's dgrad
(dx = AR(dy @ w)) runs these on (dyq, transposed(wq)).
"""
from __future__ import annotations

import torch

from ...runtime import sums, wire_dtype
from ...runtime.fp8 import Quantized
from ...runtime.scaled_mm import scaled_partial, scaled_producer
from ..registry import register
from .plain import all_reduce_ring, all_reduce_sliced, all_reduce_whole

OP_FP8 = "matmul_all_reduce.fp8"


def _output(xq: Quantized, wq: Quantized, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(tuple(xq.data.shape[:-1]) + (wq.data.shape[0],), dtype=dtype, device=xq.data.device)


@register(OP_FP8, "reference")
def ar_matmul_fp8_reference(xq, wq, group, ctx, plan, tail=None):
    """Unfused: one scaled GEMM, its fp32 partial rounded to the wire dtype, one dist.all_reduce."""
    y = scaled_partial(xq, wq)(xq.data).to(wire_dtype(xq.dtype, plan.wire_dtype))  # [s, b, h]
    all_reduce_whole(y, group, ctx, tail)
    return y.to(xq.dtype)


@register(OP_FP8, "slicing")
def ar_matmul_fp8_slicing(xq, wq, group, ctx, plan, tail=None):
    """Data slicing: one scaled GEMM per row chunk, its all-reduce in flight while the next multiplies."""
    y, gemm = _output(xq, wq, wire_dtype(xq.dtype, plan.wire_dtype)), scaled_partial(xq, wq)

    def fill(a, b):
        y[a:b] = gemm(xq.data[a:b])  # fp32, rounded to the wire dtype
    all_reduce_sliced(y, fill, group, ctx, plan, tail)
    return y.to(xq.dtype)


@register(OP_FP8, "flash")
@register(OP_FP8, "flash_bidir")
def ar_matmul_fp8_ring(xq, wq, group, ctx, plan, tail=None):
    """Chunked Flash-RS + Flash-AG (plain.py all_reduce_ring), each partial one scaled GEMM."""
    return all_reduce_ring(_output(xq, wq, xq.dtype), lambda a: scaled_producer(xq, wq, offset=a),
                           sums(xq.dtype, xq.data.device, plan.wire_dtype), group, ctx, plan, tail)
