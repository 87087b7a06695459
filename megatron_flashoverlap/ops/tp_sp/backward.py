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
"matmul_reduce_scatter.backward" (row): (dy, saved..., weight, group, ctx, plan, dw) -> (dx, dW or None).
`plan` is the forward's OpPlan (ops/registry.py): its ring's direction and sub-chunks per hop serve every ring of
the backward too, its wire dtype the column dgrad RS (sums kept in fp32, sent in plan.wire_dtype: "input", stock's
bytes, or "fp32"; runtime/numerics.py), as the forward RS does. `dw` is where dW goes (a WgradRoute), None
when autograd wants none:
  dw.into [n, h] (e.g. Megatron's fp32 `main_grad`, gradient_accumulation_fusion): each slice's dW is added
      straight into it (runtime.numerics.add_wgrad: no [n, h] temporary) and the returned dW is None;
  dw.fn(dy_full, x_full) (e.g. the data-parallel reduce-scatter of dW, megatron/ddp/grad_sync.py): the walk keeps the
      operand it gathers (AG(x) for the column, AG(dy) for the row) instead of adding dW slices, then hands
      this rank's complete dW operands to dw.fn once (its GEMM runs inside the DP ring); dW = what it returns;
  neither: dW is summed and returned.
"""
from __future__ import annotations

import torch

from ...runtime import gather, gather_and_consume, partial_producer, rows_writer, scatter, sums, walk, wgrad
from ...runtime.numerics import add_wgrad, wgrad_result, wgrad_target
from ..registry import keeping, register, ring_of
from .ag_matmul import ag_matmul_reference, ag_matmul_slicing, gather_reference
from .matmul_rs import rs_matmul_reference, rs_matmul_ring, rs_matmul_slicing

COLUMN, ROW = "all_gather_matmul.backward", "matmul_reduce_scatter.backward"


def _whole_wgrad(dy, x, weight, dw):
    """The unfused paths' one wgrad GEMM, where `dw` routes it: dw.fn's, added into dw.into, or
    dy^T x rounded to weight.dtype (stock); None when no dW is wanted."""
    if dw is None:
        return None
    if dw.fn is not None:
        return dw.fn(dy, x)
    if dw.into is None:
        return wgrad(dy, x).to(weight.dtype)
    add_wgrad(dw.into, dy, x)
    return None


def _column_dw(dy, x_shard, gathered, weight, group, dw):
    """dW of the unfused column backward from AG(x): kept, or re-gathered with the stock collective."""
    if dw is None:
        return None
    return _whole_wgrad(dy, gathered if gathered is not None else gather_reference(x_shard, group), weight, dw)


@register(COLUMN, "reference")
def column_backward_reference(dy, x_shard, gathered, weight, group, ctx, plan, dw):
    """-> (dx [s/P, b, h], dW [n/P, h] or None): stock RS of dy @ w; dW = AG(x)^T dy."""
    return rs_matmul_reference(dy, weight.t(), group, ctx, plan), _column_dw(dy, x_shard, gathered, weight, group, dw)


@register(COLUMN, "slicing")
def column_backward_slicing(dy, x_shard, gathered, weight, group, ctx, plan, dw):
    return rs_matmul_slicing(dy, weight.t(), group, ctx, plan), _column_dw(dy, x_shard, gathered, weight, group, dw)


@register(COLUMN, "flash")
@register(COLUMN, "flash_bidir")
def column_backward_ring(dy, x_shard, gathered, weight, group, ctx, plan, dw):
    """The dgrad RS and the wgrad AG of x in ONE walk; from a kept AG(x) only the RS runs on the ring."""
    if gathered is None and dw is not None:
        return _column_backward_merged(dy, x_shard, weight, group, ctx, plan, dw)
    return rs_matmul_ring(dy, weight.t(), group, ctx, plan), _column_dw(dy, x_shard, gathered, weight, group, dw)


def _column_backward_merged(dy, x_shard, weight, group, ctx, plan, dw):
    acc = wgrad_target(weight, dw.into) if dw.fn is None else None
    full = None if dw.fn is None else x_shard.new_empty((dy.shape[0],) + tuple(x_shard.shape[1:]))  # [s, b, h]

    def consume(span, xs):
        if full is not None:
            full[span[0]:span[1]].copy_(xs)  # AG(x) kept for dw.fn
        else:
            add_wgrad(acc, dy[span[0]:span[1]], xs)  # += dy[span]^T xs, in place

    block = (x_shard.shape[0],) + tuple(dy.shape[1:-1]) + (weight.shape[1],)  # [s/P, b, h]
    rs = scatter(partial_producer(dy, weight.t()), block, sums(dy.dtype, dy.device, plan.wire_dtype), group, ctx,
                 ring_of(plan, "bwd.rs", tag=0))
    ag = gather(x_shard, consume, group, ctx, ring_of(plan, "bwd.ag", tag=1))
    walk(group, ctx, rs, ag)
    if full is not None:
        return rs.handler.result(), dw.fn(dy, full)
    return rs.handler.result(), wgrad_result(weight, acc, dw.into)


def _row_unfused(ag_matmul, dy, x, weight, group, ctx, plan, dw):
    dx, full = ag_matmul(dy, weight.t(), None, group, ctx, keeping(plan))
    return dx, _whole_wgrad(full, x, weight, dw)


@register(ROW, "reference")
def row_backward_reference(dy, x, weight, group, ctx, plan, dw):
    """-> (dx [s, b, k/P], dW [h, k/P] or None): stock AG of dy, then the two GEMMs."""
    return _row_unfused(ag_matmul_reference, dy, x, weight, group, ctx, plan, dw)


@register(ROW, "slicing")
def row_backward_slicing(dy, x, weight, group, ctx, plan, dw):
    return _row_unfused(ag_matmul_slicing, dy, x, weight, group, ctx, plan, dw)


@register(ROW, "flash")
@register(ROW, "flash_bidir")
def row_backward_ring(dy, x, weight, group, ctx, plan, dw):
    """One Flash-AG of dy; each arrived dy shard gives its dx rows and adds to dW (or to dw.into), or is
    kept in AG(dy) for dw.fn."""
    fn = None if dw is None else dw.fn
    into = None if dw is None else dw.into
    out = torch.empty(tuple(x.shape), dtype=x.dtype, device=x.device)  # dx
    acc = wgrad_target(weight, into, dw is not None) if fn is None else None
    full = None if fn is None else dy.new_empty(tuple(x.shape[:-1]) + (dy.shape[-1],))  # AG(dy) [s, b, h]
    write_dx = rows_writer(out, weight.t())

    def consume(span, dys):
        write_dx(span, dys)  # dx[span] = dys @ w, straight into dx's rows
        if full is not None:
            full[span[0]:span[1]].copy_(dys)
        elif acc is not None:
            add_wgrad(acc, dys, x[span[0]:span[1]])

    gather_and_consume(dy, consume, group, ctx, ring_of(plan, "bwd.ag"))
    return out, (fn(full, x) if fn is not None else wgrad_result(weight, acc, into))
