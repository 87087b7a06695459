"""The public operators: autograd.Functions whose backward calls the dual pass, and their wrappers.

    all_gather_matmul(x_shard [s/P, b, h], weight [n/P, h], group, bias [n/P]) -> y [s, b, n/P]
        y = AG(x) @ w^T + bias              backward: dx = RS(dy @ w), dw = AG(x)^T dy, db = sum dy
    matmul_reduce_scatter(x [s, b, k/P], weight [h, k/P], group) -> y [s/P, b, h]
        y = RS(x @ w^T)                     backward: dx = AG(dy) @ w, dw = AG(dy)^T x

algo: "flash" (decomposed ring, rank-adaptive), "flash_bidir" (the same on a bidirectional ring),
"slicing" (data slicing with `num_chunks`, the baseline), "reference" (collective, then GEMM).
wire_dtype: what reduce-scatter partials (forward RS, column dgrad RS) travel in: "input" (default, stock's
bytes; sums kept in fp32 and rounded per hop) or "fp32" (twice the bytes, one rounding; runtime/numerics.py).
`force_reference()` routes every call to "reference". A group of size 1 is a plain GEMM.
hop_chunks (algo "flash" only): row sub-chunks per hop, each its own transfer posted ahead (None: automatic,
1 by measurement, ops/tp_sp/hops.py); forward and backward rings use the same count.
wgrad_into [n, h] (optional, e.g. Megatron's fp32 main_grad): dw is added into it slice by slice instead of
being returned; the weight then gets Megatron's dummy gradient (runtime/accumulate.py: weight_grad).
wgrad_fn(dy_full, x_full) -> the weight's autograd gradient (optional, instead of wgrad_into; e.g. the
data-parallel reduce-scatter of dW inside its GEMM, megatron/ddp.py): backward keeps the operand it gathers
and hands this rank's complete dW operands to it once (backward.py).
"""
from __future__ import annotations

import math

import torch

from ...runtime import OverlapContext, group_info
from ...runtime.accumulate import linear_into, weight_grad
from ..checks import checked_context
from ..registry import plain, resolve
from . import ag_matmul, backward, matmul_rs  # noqa: F401  (they fill the registry's tables)
from .hops import check_hop_chunks, hop_chunks_for


class AllGatherMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_shard, weight, bias, group, octx, algo, num_chunks, keep_gathered, wire, wgrad_into,
                wgrad_fn, hop_chunks):
        y, gathered = plain(ag_matmul.OP, algo)(x_shard, weight, bias, group, octx, num_chunks=num_chunks,
                                                keep_gathered=keep_gathered, hop_chunks=hop_chunks)
        ctx.save_for_backward(x_shard, weight, gathered)
        ctx.group, ctx.octx, ctx.algo, ctx.num_chunks, ctx.has_bias = group, octx, algo, num_chunks, bias is not None
        ctx.wire = wire
        ctx.wgrad_into = wgrad_into  # not saved: an in-place target (as Megatron keeps main_grad on ctx)
        ctx.wgrad_fn, ctx.hop_chunks = wgrad_fn, hop_chunks
        return y

    @staticmethod
    def backward(ctx, dy):
        x_shard, weight, gathered = ctx.saved_tensors
        need_dw, into = ctx.needs_input_grad[1], ctx.wgrad_into
        dx, dw = plain(backward.COLUMN, ctx.algo)(dy.contiguous(), x_shard, gathered, weight, ctx.group, ctx.octx,
                                                  num_chunks=ctx.num_chunks, need_dw=need_dw, wgrad_into=into,
                                                  wire=ctx.wire, wgrad_fn=ctx.wgrad_fn, hop_chunks=ctx.hop_chunks)
        if need_dw and into is not None:
            dw = weight_grad(weight, into, x_shard.dtype)
        db = dy.sum(dim=tuple(range(dy.dim() - 1))) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, dw, db, None, None, None, None, None, None, None, None, None


class MatmulReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, group, octx, algo, num_chunks, wire, wgrad_into, wgrad_fn, hop_chunks):
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.octx, ctx.algo, ctx.num_chunks, ctx.wgrad_into = group, octx, algo, num_chunks, wgrad_into
        ctx.wgrad_fn, ctx.hop_chunks = wgrad_fn, hop_chunks
        return plain(matmul_rs.OP, algo)(x, weight, group, octx, num_chunks=num_chunks, wire=wire,
                                         hop_chunks=hop_chunks)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        need_dw, into = ctx.needs_input_grad[1], ctx.wgrad_into
        dx, dw = plain(backward.ROW, ctx.algo)(dy.contiguous(), x, weight, ctx.group, ctx.octx,
                                               num_chunks=ctx.num_chunks, need_dw=need_dw, wgrad_into=into,
                                               wgrad_fn=ctx.wgrad_fn, hop_chunks=ctx.hop_chunks)
        if need_dw and into is not None:
            dw = weight_grad(weight, into, x.dtype)
        return dx, dw, None, None, None, None, None, None, None, None


def all_gather_matmul(x_shard: torch.Tensor, weight: torch.Tensor, group=None, *, bias: torch.Tensor | None = None,
                      algo: str = "flash", num_chunks: int | None = None, keep_gathered: bool = False,
                      wire_dtype: str = "input", context: OverlapContext | None = None,
                      wgrad_into: torch.Tensor | None = None, wgrad_fn=None, hop_chunks: int | None = None
                      ) -> torch.Tensor:
    """y [s, b, n/P] = AG(x_shard [s/P, b, h]) @ weight[n/P, h]^T (+ bias [n/P]), with autograd.

    keep_gathered: keep AG(x) from forward for the weight gradient (memory for time) instead of
    re-gathering it with Flash-AG in backward. wire_dtype: of the dgrad RS partials ("input" | "fp32").
    wgrad_into [n/P, h]: dw is added into it (module docstring). hop_chunks: sub-chunks per hop (flash)."""
    check_hop_chunks("all_gather_matmul", algo, hop_chunks)
    algo, num_chunks = resolve("all_gather_matmul", algo, num_chunks)
    ctx = checked_context("all_gather_matmul", x_shard, weight, bias, group, context,
                          wire_dtype=wire_dtype, wgrad_into=wgrad_into, wgrad_fn=wgrad_fn)
    if ctx is None:
        return linear_into(x_shard, weight, bias, wgrad_into, wgrad_fn)
    hops = hop_chunks_for(algo, hop_chunks, group_info(group)[1], x_shard.shape[0], _row_width(x_shard))
    return AllGatherMatmul.apply(x_shard, weight, bias, group, ctx, algo, num_chunks, keep_gathered, wire_dtype,
                                 wgrad_into, wgrad_fn, hops)


def matmul_reduce_scatter(x: torch.Tensor, weight: torch.Tensor, group=None, *, algo: str = "flash",
                          num_chunks: int | None = None, wire_dtype: str = "input",
                          context: OverlapContext | None = None,
                          wgrad_into: torch.Tensor | None = None, wgrad_fn=None, hop_chunks: int | None = None
                          ) -> torch.Tensor:
    """y [s/P, b, h] = RS(x [s, b, k/P] @ weight[h, k/P]^T), with autograd; partial sums kept in fp32 for
    bf16/fp16, sent in wire_dtype ("input": the input dtype, stock's bytes; "fp32").
    wgrad_into [h, k/P]: dw is added into it (module docstring). hop_chunks: sub-chunks per hop (flash)."""
    check_hop_chunks("matmul_reduce_scatter", algo, hop_chunks)
    algo, num_chunks = resolve("matmul_reduce_scatter", algo, num_chunks)
    ctx = checked_context("matmul_reduce_scatter", x, weight, None, group, context, divisible=True,
                          wire_dtype=wire_dtype, wgrad_into=wgrad_into, wgrad_fn=wgrad_fn)
    if ctx is None:
        return linear_into(x, weight, None, wgrad_into, wgrad_fn)
    world = group_info(group)[1]
    hops = hop_chunks_for(algo, hop_chunks, world, x.shape[0] // world, _row_width(x))
    return MatmulReduceScatter.apply(x, weight, group, ctx, algo, num_chunks, wire_dtype, wgrad_into, wgrad_fn, hops)


def _row_width(x: torch.Tensor) -> int:
    """GEMM rows per sequence row of x [s, b, h]: b."""
    return math.prod(x.shape[1:-1])
