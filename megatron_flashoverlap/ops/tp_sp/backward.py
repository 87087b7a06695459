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
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ...runtime import execute, group_info
from ...schedules import all_gather_ring, merge, reduce_scatter_ring
from .ag_matmul import ag_matmul_reference, ag_matmul_slicing, gather_reference
from .matmul_rs import acc_dtype, rs_matmul_flash, rs_matmul_reference, rs_matmul_slicing
from ...runtime.handlers import GatherPass, ScatterPass


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])  # [s, b, h] -> [s*b, h]


def _wgrad(dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """dy [r, b, n], x [r, b, h] -> dw [n, h] = dy^T x, in the accumulation dtype."""
    return torch.mm(_flat(dy).t(), _flat(x)).to(acc_dtype(x.dtype))


def column_backward(dy, x_shard, gathered, weight, group, ctx, algo, num_chunks, need_dw=True):
    """-> (dx [s/P, b, h], dw [n/P, h] or None)."""
    dy = dy.contiguous()
    if algo in ("flash", "flash_bidir") and gathered is None and need_dw:
        return _column_backward_flash(dy, x_shard, weight, group, ctx, algo == "flash_bidir")
    if algo in ("flash", "flash_bidir"):
        dx = rs_matmul_flash(dy, weight.t(), group, ctx, algo == "flash_bidir")
    elif algo == "slicing":
        dx = rs_matmul_slicing(dy, weight.t(), group, ctx, num_chunks)
    else:
        dx = rs_matmul_reference(dy, weight.t(), group, ctx)
    if not need_dw:
        return dx, None
    full = gathered if gathered is not None else gather_reference(x_shard, group)
    return dx, _wgrad(dy, full).to(weight.dtype)


def _column_backward_flash(dy, x_shard, weight, group, ctx, bidirectional):
    rank, world = group_info(group)
    rows = x_shard.shape[0]
    dw = torch.zeros(weight.shape, dtype=acc_dtype(weight.dtype), device=weight.device)

    def consume(span, xs):
        dw.add_(_wgrad(dy[span[0]:span[1]], xs))

    rs_s = reduce_scatter_ring(rank, world, bidirectional=bidirectional, tag=0)
    ag_s = all_gather_ring(rank, world, bidirectional=bidirectional, tag=1)
    rs = ScatterPass(rows, rank, rs_s.parts, lambda span: F.linear(dy[span[0]:span[1]], weight.t()),
                     tuple(dy.shape[1:-1]) + (weight.shape[1],), acc_dtype(dy.dtype), dy.dtype, dy.device,
                     ctx, name="bwd.rs", tag=0)
    ag = GatherPass(x_shard, rank, world, ag_s.parts, consume, ctx, name="bwd.ag", tag=1)
    execute(merge(rs_s, ag_s), group, {0: rs, 1: ag}, ctx)
    return rs.result(), dw.to(weight.dtype)


def row_backward(dy, x, weight, group, ctx, algo, num_chunks, need_dw=True):
    """-> (dx [s, b, k/P], dw [h, k/P] or None)."""
    dy = dy.contiguous()
    if algo in ("flash", "flash_bidir"):
        return _row_backward_flash(dy, x, weight, group, ctx, algo == "flash_bidir", need_dw)
    if algo == "slicing":
        dx, full = ag_matmul_slicing(dy, weight.t(), None, group, ctx, num_chunks, keep_gathered=True)
    else:
        dx, full = ag_matmul_reference(dy, weight.t(), None, group, ctx, keep_gathered=True)
    return dx, (_wgrad(full, x).to(weight.dtype) if need_dw else None)


def _row_backward_flash(dy, x, weight, group, ctx, bidirectional, need_dw):
    rank, world = group_info(group)
    dx = torch.empty(tuple(x.shape), dtype=x.dtype, device=x.device)
    dw = torch.zeros(weight.shape, dtype=acc_dtype(weight.dtype), device=weight.device) if need_dw else None

    def consume(span, dys):
        dx[span[0]:span[1]] = F.linear(dys, weight.t())
        if dw is not None:
            dw.add_(_wgrad(dys, x[span[0]:span[1]]))

    sched = all_gather_ring(rank, world, bidirectional=bidirectional)
    execute(sched.steps, group, {0: GatherPass(dy, rank, world, sched.parts, consume, ctx, name="bwd.ag")}, ctx)
    return dx, (dw.to(weight.dtype) if dw is not None else None)
