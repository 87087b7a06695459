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
(dy, saved..., weight, group, ctx, *, num_chunks, need_dw, wgrad_into=None, wgrad_fn=None, hop_chunks=1) -> (dx, dw
or None); hop_chunks (flash): the forward's sub-chunks per hop, used by every ring of the backward too.
wgrad_fn(dy_full, x_full) (e.g. the data-parallel reduce-scatter of dW, megatron/ddp.py): the walk keeps the
operand it gathers (AG(x) for the column, AG(dy) for the row) instead of adding dw slices, then hands this
rank's complete dW operands to wgrad_fn once (its GEMM runs inside the DP ring); dw = what it returns.
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
                    wire, wgrad_fn=None):
    """dx by the given GEMM + RS function; dw from AG(x) (kept, or re-gathered with the stock collective)."""
    dx = rs_matmul(dy, weight.t(), group, ctx, num_chunks=num_chunks, wire=wire)
    if not need_dw:
        return dx, None
    full = gathered if gathered is not None else gather_reference(x_shard, group)
    return dx, (wgrad_fn(dy, full) if wgrad_fn is not None else _whole_wgrad(dy, full, weight, into))


@register(COLUMN, "reference")
def column_backward_reference(dy, x_shard, gathered, weight, group, ctx, *, num_chunks=1, need_dw=True,
                              wgrad_into=None, wire="input", wgrad_fn=None, hop_chunks=1):
    """-> (dx [s/P, b, h], dw [n/P, h] or None): stock RS of dy @ w; dw = AG(x)^T dy."""
    return _column_unfused(rs_matmul_reference, dy, x_shard, gathered, weight, group, ctx, num_chunks, need_dw,
                           wgrad_into, wire, wgrad_fn)


@register(COLUMN, "slicing")
def column_backward_slicing(dy, x_shard, gathered, weight, group, ctx, *, num_chunks, need_dw=True, wgrad_into=None,
                            wire="input", wgrad_fn=None, hop_chunks=1):
    return _column_unfused(rs_matmul_slicing, dy, x_shard, gathered, weight, group, ctx, num_chunks, need_dw,
                           wgrad_into, wire, wgrad_fn)


@register(COLUMN, "flash")
@register(COLUMN, "flash_bidir", bidirectional=True)
def column_backward_ring(dy, x_shard, gathered, weight, group, ctx, *, num_chunks=1, need_dw=True,
                         wgrad_into=None, wire="input", bidirectional=False, wgrad_fn=None, hop_chunks=1):
    """The dgrad RS and the wgrad AG of x in ONE walk; from a kept AG(x) only the RS runs on the ring."""
    if gathered is None and need_dw:
        return _column_backward_merged(dy, x_shard, weight, group, ctx, bidirectional, wgrad_into, wire, wgrad_fn,
                                       hop_chunks)
    rs = functools.partial(rs_matmul_ring, bidirectional=bidirectional, hop_chunks=hop_chunks)
    return _column_unfused(rs, dy, x_shard, gathered, weight, group, ctx, num_chunks, need_dw, wgrad_into, wire,
                           wgrad_fn)


def _column_backward_merged(dy, x_shard, weight, group, ctx, bidirectional, into, wire, wgrad_fn=None, hop_chunks=1):
    dw = wgrad_target(weight, into) if wgrad_fn is None else None
    full = None if wgrad_fn is None else x_shard.new_empty((dy.shape[0],) + tuple(x_shard.shape[1:]))  # [s, b, h]

    def consume(span, xs):
        if full is not None:
            full[span[0]:span[1]].copy_(xs)  # AG(x) kept for wgrad_fn
        else:
            add_wgrad(dw, dy[span[0]:span[1]], xs)  # += dy[span]^T xs, in place

    produce, in_place = partial_producer(dy, weight.t())
    rs = scatter(produce, x_shard.shape[0], tuple(dy.shape[1:-1]) + (weight.shape[1],), group, ctx,
                 acc_dtype=acc_dtype(dy.dtype), out_dtype=dy.dtype, device=dy.device,
                 wire_dtype=wire_dtype(dy.dtype, wire), bidirectional=bidirectional, name="bwd.rs", tag=0,
                 into=in_place, hop_chunks=hop_chunks)
    ag = gather(x_shard, consume, group, ctx, bidirectional=bidirectional, name="bwd.ag", tag=1, hop_chunks=hop_chunks)
    walk(group, ctx, rs, ag)
    if full is not None:
        return rs.handler.result(), wgrad_fn(dy, full)
    return rs.handler.result(), wgrad_result(weight, dw, into)


def _row_unfused(ag_matmul, dy, x, weight, group, ctx, num_chunks, need_dw, into, wgrad_fn=None):
    dx, full = ag_matmul(dy, weight.t(), None, group, ctx, num_chunks=num_chunks, keep_gathered=True)
    if not need_dw:
        return dx, None
    return dx, (wgrad_fn(full, x) if wgrad_fn is not None else _whole_wgrad(full, x, weight, into))


@register(ROW, "reference")
def row_backward_reference(dy, x, weight, group, ctx, *, num_chunks=1, need_dw=True, wgrad_into=None, wgrad_fn=None,
                           hop_chunks=1):
    """-> (dx [s, b, k/P], dw [h, k/P] or None): stock AG of dy, then the two GEMMs."""
    return _row_unfused(ag_matmul_reference, dy, x, weight, group, ctx, num_chunks, need_dw, wgrad_into, wgrad_fn)


@register(ROW, "slicing")
def row_backward_slicing(dy, x, weight, group, ctx, *, num_chunks, need_dw=True, wgrad_into=None, wgrad_fn=None,
                         hop_chunks=1):
    return _row_unfused(ag_matmul_slicing, dy, x, weight, group, ctx, num_chunks, need_dw, wgrad_into, wgrad_fn)


@register(ROW, "flash")
@register(ROW, "flash_bidir", bidirectional=True)
def row_backward_ring(dy, x, weight, group, ctx, *, num_chunks=1, need_dw=True, wgrad_into=None,
                      bidirectional=False, wgrad_fn=None, hop_chunks=1):
    """One Flash-AG of dy; each arrived dy shard gives its dx rows and adds to dw (or to wgrad_into), or is
    kept in AG(dy) for wgrad_fn."""
    dx = torch.empty(tuple(x.shape), dtype=x.dtype, device=x.device)
    fn = wgrad_fn if need_dw else None
    dw = wgrad_target(weight, wgrad_into, need_dw) if fn is None else None
    full = None if fn is None else dy.new_empty(tuple(x.shape[:-1]) + (dy.shape[-1],))  # AG(dy) [s, b, h]
    write_dx = rows_writer(dx, weight.t())

    def consume(span, dys):
        write_dx(span, dys)  # dx[span] = dys @ w, straight into dx's rows
        if full is not None:
            full[span[0]:span[1]].copy_(dys)
        elif dw is not None:
            add_wgrad(dw, dys, x[span[0]:span[1]])

    gather_and_consume(dy, consume, group, ctx, bidirectional=bidirectional, name="bwd.ag", hop_chunks=hop_chunks)
    return dx, (fn(full, x) if fn is not None else wgrad_result(weight, dw, wgrad_into))
