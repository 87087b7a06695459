"""Backward passes of the two operators; each is the dual of its forward.

Column (forward AG + GEMM), given dy [s, b, n/P], x_shard [s/P, b, h], w [n/P, h]:
    dx [s/P, b, h] = RS(dy @ w)        dw [n/P, h] = AG(x)^T @ dy
  flash: one ring walk carries both: the dgrad RS (tag 0, own block last) and the wgrad AG of x
  (tag 1, local shard first); each step multiplies one dgrad slice and one wgrad slice while the two
  hops of that step fly:
      comm    |RS hop i  + AG hop i|RS hop i+1 + AG hop i+1| ...
      compute | dy[d_i]@w , dw += dy[src_i]^T x[src_i] | ...
Row (forward GEMM + RS), given dy [s/P, b, h], x [s, b, k/P], w [h, k/P]:
    dx [s, b, k/P] = AG(dy) @ w        dw [h, k/P] = AG(dy)^T @ x
  flash: one Flash-AG of dy; each arrived dy shard gives its dx rows and adds to dw.
Weight gradients are summed in fp32 for bf16/fp16 (across slices the sum order differs from one GEMM).
Plain functions, one per algorithm, registered as "all_gather_matmul.backward" (column) and
"matmul_reduce_scatter.backward" (row): (dy, saved..., weight, group, ctx, *, num_chunks, need_dw) -> (dx, dw).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ...runtime import acc_dtype, gather, gather_and_consume, rows_writer, scatter, walk, wgrad
from ...runtime.numerics import partial_producer, wgrad_by_rows, zeros_acc
from ..registry import register
from .ag_matmul import ag_matmul_reference, ag_matmul_slicing, gather_reference
from .matmul_rs import rs_matmul_reference, rs_matmul_ring, rs_matmul_slicing

COLUMN, ROW = "all_gather_matmul.backward", "matmul_reduce_scatter.backward"


def _column_unfused(rs_matmul, dy, x_shard, gathered, weight, group, ctx, num_chunks, need_dw):
    """dx by the given GEMM + RS function; dw from AG(x) (kept, or re-gathered with the stock collective)."""
    dx = rs_matmul(dy, weight.t(), group, ctx, num_chunks=num_chunks)
    if not need_dw:
        return dx, None
    full = gathered if gathered is not None else gather_reference(x_shard, group)
    return dx, wgrad(dy, full).to(weight.dtype)


@register(COLUMN, "reference")
def column_backward_reference(dy, x_shard, gathered, weight, group, ctx, *, num_chunks=1, need_dw=True):
    """-> (dx [s/P, b, h], dw [n/P, h] or None): stock RS of dy @ w; dw = AG(x)^T dy."""
    return _column_unfused(rs_matmul_reference, dy, x_shard, gathered, weight, group, ctx, num_chunks, need_dw)


@register(COLUMN, "slicing")
def column_backward_slicing(dy, x_shard, gathered, weight, group, ctx, *, num_chunks, need_dw=True):
    return _column_unfused(rs_matmul_slicing, dy, x_shard, gathered, weight, group, ctx, num_chunks, need_dw)


@register(COLUMN, "flash")
@register(COLUMN, "flash_bidir", bidirectional=True)
def column_backward_ring(dy, x_shard, gathered, weight, group, ctx, *, num_chunks=1, need_dw=True,
                         bidirectional=False):
    """The dgrad RS and the wgrad AG of x in ONE walk; from a kept AG(x) only the RS runs on the ring."""
    if gathered is None and need_dw:
        return _column_backward_merged(dy, x_shard, weight, group, ctx, bidirectional)
    rs = functools.partial(rs_matmul_ring, bidirectional=bidirectional)
    return _column_unfused(rs, dy, x_shard, gathered, weight, group, ctx, num_chunks, need_dw)


def _column_backward_merged(dy, x_shard, weight, group, ctx, bidirectional):
    dw, part = zeros_acc(weight), wgrad_by_rows(dy, fixed_is_dy=True)

    def consume(span, xs):
        dw.add_(part(span, xs))  # += dy[span]^T xs

    produce, into = partial_producer(dy, weight.t())
    rs = scatter(produce, x_shard.shape[0], tuple(dy.shape[1:-1]) + (weight.shape[1],), group, ctx,
                 acc_dtype=acc_dtype(dy.dtype), out_dtype=dy.dtype, device=dy.device, bidirectional=bidirectional,
                 name="bwd.rs", tag=0, into=into)
    ag = gather(x_shard, consume, group, ctx, bidirectional=bidirectional, name="bwd.ag", tag=1)
    walk(group, ctx, rs, ag)
    return rs.handler.result(), dw.to(weight.dtype)


def _row_unfused(ag_matmul, dy, x, weight, group, ctx, num_chunks, need_dw):
    dx, full = ag_matmul(dy, weight.t(), None, group, ctx, num_chunks=num_chunks, keep_gathered=True)
    return dx, (wgrad(full, x).to(weight.dtype) if need_dw else None)


@register(ROW, "reference")
def row_backward_reference(dy, x, weight, group, ctx, *, num_chunks=1, need_dw=True):
    """-> (dx [s, b, k/P], dw [h, k/P] or None): stock AG of dy, then the two GEMMs."""
    return _row_unfused(ag_matmul_reference, dy, x, weight, group, ctx, num_chunks, need_dw)


@register(ROW, "slicing")
def row_backward_slicing(dy, x, weight, group, ctx, *, num_chunks, need_dw=True):
    return _row_unfused(ag_matmul_slicing, dy, x, weight, group, ctx, num_chunks, need_dw)


@register(ROW, "flash")
@register(ROW, "flash_bidir", bidirectional=True)
def row_backward_ring(dy, x, weight, group, ctx, *, num_chunks=1, need_dw=True, bidirectional=False):
    """One Flash-AG of dy; each arrived dy shard gives its dx rows and adds to dw."""
    dx = torch.empty(tuple(x.shape), dtype=x.dtype, device=x.device)
    dw = zeros_acc(weight) if need_dw else None
    write_dx, part = rows_writer(dx, weight.t()), wgrad_by_rows(x, fixed_is_dy=False)

    def consume(span, dys):
        write_dx(span, dys)  # dx[span] = dys @ w, straight into dx's rows
        if dw is not None:
            dw.add_(part(span, dys))  # += dys^T x[span]

    gather_and_consume(dy, consume, group, ctx, bidirectional=bidirectional, name="bwd.ag")
    return dx, (dw.to(weight.dtype) if dw is not None else None)
