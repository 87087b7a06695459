"""The Megatron linear GEMM with its weight gradient routed through `dp_wgrad`, and the one-call wrapper.

    x [s/tp or s, b, k]   weight [n, k]   bias [n]   y [s, b, n]
    forward  y = (AG_tp(x) if sequence_parallel else x) @ w^T + bias
    dgrad    dx = dy @ w, then all-reduce over tp (allreduce_dgrad) or reduce-scatter (SP), async, as
             Megatron's LinearWithGradAccumulationAndAsyncCommunication, overlapped with the wgrad below
    wgrad    dw = dy^T AG_tp(x): `dp_wgrad` -> for a flash weight, reduce-scattered over DP inside the GEMM

`linear_dp_forward_impl` has the signature of Megatron's `_forward_impl` / `linear_with_grad_accumulation_
and_async_allreduce`, so a stock `ColumnParallelLinear` / `RowParallelLinear` uses it by instance attribute
(`module._forward_impl = linear_dp_forward_impl`); the plugin's own layers call `dp_wgrad` in their backward.
"""
from __future__ import annotations

import logging

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..runtime import all_gather_into, group_info, reduce_scatter_into
from .ddp import dp_wgrad, enable_dp_overlap, isolated_buckets

log = logging.getLogger(__name__)


def _gather(x, group):
    rank, world = group_info(group)
    if world == 1:
        return x
    out = torch.empty((x.shape[0] * world,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    all_gather_into(out, x.contiguous(), group)
    return out


class LinearDPWgrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, allreduce_dgrad, sequence_parallel, tp_group):
        ctx.save_for_backward(x, weight)
        ctx.flags = (bias is not None, allreduce_dgrad, sequence_parallel, tp_group)
        total = _gather(x, tp_group) if sequence_parallel else x
        return F.linear(total, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        has_bias, allreduce_dgrad, sequence_parallel, tp_group = ctx.flags
        dy = dy.contiguous()
        total = _gather(x, tp_group) if sequence_parallel else x
        dx = dy.matmul(weight)
        work = None
        if sequence_parallel and group_info(tp_group)[1] > 1:
            full, dx = dx, torch.empty(tuple(x.shape), dtype=dx.dtype, device=dx.device)
            work = reduce_scatter_into(dx, full, tp_group, async_op=True)
        elif allreduce_dgrad and group_info(tp_group)[1] > 1:
            work = dist.all_reduce(dx, group=tp_group, async_op=True)
        dw = dp_wgrad(weight, dy, total,  # the TP collective of dx is in flight meanwhile
                      lambda: torch.mm(dy.reshape(-1, dy.shape[-1]).t(), total.reshape(-1, total.shape[-1])))
        db = dy.sum(dim=tuple(range(dy.dim() - 1))) if has_bias and ctx.needs_input_grad[2] else None
        if work is not None:
            work.wait()
        return dx, dw, db, None, None, None


def linear_dp_forward_impl(input, weight, bias=None, gradient_accumulation_fusion=False, allreduce_dgrad=False,
                           sequence_parallel=False, grad_output_buffer=None, wgrad_deferral_limit=None,
                           tp_group=None, **kwargs):
    """Drop-in for Megatron's `linear_with_grad_accumulation_and_async_allreduce` (same keywords)."""
    if gradient_accumulation_fusion or grad_output_buffer is not None or kwargs.get("gtp_remat_size", 1) > 1:
        raise ValueError("flash DP overlap: gradient_accumulation_fusion, deferred embedding wgrad and "
                         "gtp_remat are not supported on this path; turn them off or leave this layer stock")
    if tp_group is None and (allreduce_dgrad or sequence_parallel):
        from megatron.core import parallel_state
        tp_group = parallel_state.get_tensor_model_parallel_group()
    return LinearDPWgrad.apply(input, weight, bias, allreduce_dgrad, sequence_parallel, tp_group)


def _linears(module):
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    return [m for m in module.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))
            and getattr(m, "weight", None) is not None and m.weight.requires_grad]


def wrap_with_dp_overlap(config, ddp_config, module, *, linears=None, algo="flash", context=None, **ddp_kwargs):
    """Megatron `DistributedDataParallel(config, ddp_config, module, **ddp_kwargs)` whose selected linears
    (default: every tensor-parallel linear) reduce-scatter their weight gradient inside the wgrad GEMM.
    Returns (ddp_model, accepted_weights); the others stay stock (logged once each)."""
    from megatron.core.distributed import DistributedDataParallel

    linears = _linears(module) if linears is None else list(linears)
    with isolated_buckets([m.weight for m in linears]):
        ddp = DistributedDataParallel(config, ddp_config, module, **ddp_kwargs)
    accepted = enable_dp_overlap(ddp, [m.weight for m in linears], algo=algo, context=context)
    ids = {id(w) for w in accepted}
    for m in linears:
        if id(m.weight) in ids:  # a layer that never reaches _forward_impl stays correct: its bucket is
            m._forward_impl = linear_dp_forward_impl  # never marked reduced, so the stock collective runs
    return ddp, accepted
