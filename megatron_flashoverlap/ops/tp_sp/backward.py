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
wgrad_into [n, h] (e.g. Megatron's fp32 `main_grad`, gradient_accumulation_fusion): each slice's dw is
added straight into it (runtime.numerics.add_wgrad: no [n, h] temporary) and the returned dw is None.
Plain functions, one per algorithm, registered as "all_gather_matmul.backward" (column) and
"matmul_reduce_scatter.backward" (row):
(dy, saved..., weight, group, ctx, *, num_chunks, need_dw, wgrad_into=None) -> (dx, dw or None).
The column dgrad RS keeps its sums in fp32 and sends them in the wire dtype (`wire`: "input", stock's
bytes, or "fp32"; runtime/numerics.py), as the forward RS does.
"""
from __future__ import annotations

import functools

import torch

from ...runtime import acc_dtype, gather, gather_and_consume, rows_writer, scatter, walk, wgrad, wire_dtype
from ...runtime.numerics import add_wgrad, partial_producer, wgrad_result, wgrad_target
from ..registry import register
from .ag_matmul import ag_matmul_reference, ag_matmul_slicing, gather_reference
from .matmul_rs import rs_matmul_reference, rs_matmul_ring, rs_matmul_slicing

COLUMN, ROW = "all_gather_matmul.backward", "matmul_reduce_scatter.backward"


def _whole_wgrad(dy, x, weight, into):
    """The unfused paths' one wgrad GEMM: dw = dy^T x rounded to weight.dtype (stock), or added into `into`."""
    if into is None:
        return wgrad(dy, x).to(weight.dtype)
    add_wgrad(into, dy, x)
    return None


def _column_unfused(rs_matmul, dy, x_shard, gathered, weight, group, ctx, num_chunks, need_dw, into,
                    wire):
    """dx by the given GEMM + RS function; dw from AG(x) (kept, or re-gathered with the stock collective)."""
    dx = rs_matmul(dy, weight.t(), group, ctx, num_chunks=num_chunks, wire=wire)
    if not need_dw:
        return dx, None
    full = gathered if gathered is not None else gather_reference(x_shard, group)
    return dx, _whole_wgrad(dy, full, weight, into)


@register(COLUMN, "reference")
def column_backward_reference(dy, x_shard, gathered, weight, group, ctx, *, num_chunks=1, need_dw=True,
                              wgrad_into=None, wire="input"):
    """-> (dx [s/P, b, h], dw [n/P, h] or None): stock RS of dy @ w; dw = AG(x)^T dy."""
    return _column_unfused(rs_matmul_reference, dy, x_shard, gathered, weight, group, ctx, num_chunks, need_dw,
                           wgrad_into, wire)


@register(COLUMN, "slicing")
def column_backward_slicing(dy, x_shard, gathered, weight, group, ctx, *, num_chunks, need_dw=True, wgrad_into=None,
                            wire="input"):
    return _column_unfused(rs_matmul_slicing, dy, x_shard, gathered, weight, group, ctx, num_chunks, need_dw,
                           wgrad_into, wire)


@register(COLUMN, "flash")
@register(COLUMN, "flash_bidir", bidirectional=True)
def column_backward_ring(dy, x_shard, gathered, weight, group, ctx, *, num_chunks=1, need_dw=True,
                         wgrad_into=None, wire="input", bidirectional=False):
    """The dgrad RS and the wgrad AG of x in ONE walk; from a kept AG(x) only the RS runs on the ring."""
    if gathered is None and need_dw:
        return _column_backward_merged(dy, x_shard, weight, group, ctx, bidirectional, wgrad_into, wire)
    rs = functools.partial(rs_matmul_ring, bidirectional=bidirectional)
    return _column_unfused(rs, dy, x_shard, gathered, weight, group, ctx, num_chunks, need_dw, wgrad_into, wire)


def _column_backward_merged(dy, x_shard, weight, group, ctx, bidirectional, into, wire):
    dw = wgrad_target(weight, into)

    def consume(span, xs):
        add_wgrad(dw, dy[span[0]:span[1]], xs)  # += dy[span]^T xs, in place

    produce, in_place = partial_producer(dy, weight.t())
    rs = scatter(produce, x_shard.shape[0], tuple(dy.shape[1:-1]) + (weight.shape[1],), group, ctx,
                 acc_dtype=acc_dtype(dy.dtype), out_dtype=dy.dtype, device=dy.device,
                 wire_dtype=wire_dtype(dy.dtype, wire), bidirectional=bidirectional, name="bwd.rs", tag=0,
                 into=in_place)
    ag = gather(x_shard, consume, group, ctx, bidirectional=bidirectional, name="bwd.ag", tag=1)
    walk(group, ctx, rs, ag)
    return rs.handler.result(), wgrad_result(weight, dw, into)


def _row_unfused(ag_matmul, dy, x, weight, group, ctx, num_chunks, need_dw, into):
    dx, full = ag_matmul(dy, weight.t(), None, group, ctx, num_chunks=num_chunks, keep_gathered=True)
    return dx, (_whole_wgrad(full, x, weight, into) if need_dw else None)


@register(ROW, "reference")
def row_backward_reference(dy, x, weight, group, ctx, *, num_chunks=1, need_dw=True, wgrad_into=None):
    """-> (dx [s, b, k/P], dw [h, k/P] or None): stock AG of dy, then the two GEMMs."""
    return _row_unfused(ag_matmul_reference, dy, x, weight, group, ctx, num_chunks, need_dw, wgrad_into)


@register(ROW, "slicing")
def row_backward_slicing(dy, x, weight, group, ctx, *, num_chunks, need_dw=True, wgrad_into=None):
    return _row_unfused(ag_matmul_slicing, dy, x, weight, group, ctx, num_chunks, need_dw, wgrad_into)


@register(ROW, "flash")
@register(ROW, "flash_bidir", bidirectional=True)
def row_backward_ring(dy, x, weight, group, ctx, *, num_chunks=1, need_dw=True, wgrad_into=None,
                      bidirectional=False):
    """One Flash-AG of dy; each arrived dy shard gives its dx rows and adds to dw (or to wgrad_into)."""
    dx = torch.empty(tuple(x.shape), dtype=x.dtype, device=x.device)
    dw = wgrad_target(weight, wgrad_into, need_dw)
    write_dx = rows_writer(dx, weight.t())

    def consume(span, dys):
        write_dx(span, dys)  # dx[span] = dys @ w, straight into dx's rows
        if dw is not None:
            add_wgrad(dw, dys, x[span[0]:span[1]])

    gather_and_consume(dy, consume, group, ctx, bidirectional=bidirectional, name="bwd.ag")
    return dx, wgrad_result(weight, dw, wgrad_into)
