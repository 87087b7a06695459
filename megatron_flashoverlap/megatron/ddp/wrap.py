"""The Megatron linear GEMM with its weight gradient routed through `dp_wgrad`, and the one-call wrapper.

    x [s/tp or s, b, k]   weight [n, k]   bias [n]   y [s, b, n]
    forward  y = (AG_tp(x) if sequence_parallel else x) @ w^T + bias
    dgrad    dx = dy @ w, then all-reduce over tp (allreduce_dgrad) or reduce-scatter (SP), async, as
             Megatron's LinearWithGradAccumulationAndAsyncCommunication, overlapped with the wgrad below
    wgrad    dw = dy^T AG_tp(x): `dp_wgrad` -> for a flash weight, reduce-scattered over DP inside the GEMM

`wrap_with_dp_overlap` builds DDP with the chosen weights in buckets of their own (layout.py).
`linear_dp_forward_impl` has the signature of Megatron's `_forward_impl` / `linear_with_grad_accumulation_
and_async_allreduce`, so a stock `ColumnParallelLinear` / `RowParallelLinear` uses it by instance attribute
(`module._forward_impl = linear_dp_forward_impl`); the plugin's own layers call `dp_wgrad` in their backward.
"""
from __future__ import annotations

import logging

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ...ops.tp_sp.plain import gather_reference
from ...runtime import group_info, names_operator, reduce_scatter_into
from .grad_sync import dp_wgrad, enable_dp_overlap
from .auto_fuse import auto_linears
from .layout import isolated_buckets, relayout, stock_bucket_size

log = logging.getLogger(__name__)


@names_operator
class LinearDPWgrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, allreduce_dgrad, sequence_parallel, tp_group):
        ctx.save_for_backward(x, weight)
        ctx.flags = (bias is not None, allreduce_dgrad, sequence_parallel, tp_group)
        total = gather_reference(x, tp_group) if sequence_parallel else x
        return F.linear(total, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        has_bias, allreduce_dgrad, sequence_parallel, tp_group = ctx.flags
        dy = dy.contiguous()
        total = gather_reference(x, tp_group) if sequence_parallel else x
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


def linear_dp_forward_impl(input, weight, bias=None, **megatron):
    """Drop-in for Megatron's `linear_with_grad_accumulation_and_async_allreduce`: Megatron's `_forward_impl`
    calls it by keyword (gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel, grad_output_buffer,
    wgrad_deferral_limit, tp_group, gtp_remat_size, ...); this path reads the ones it honours or refuses."""
    if (megatron.get("gradient_accumulation_fusion") or megatron.get("grad_output_buffer") is not None
            or megatron.get("gtp_remat_size", 1) > 1):
        raise ValueError("flash DP overlap: gradient_accumulation_fusion, deferred embedding wgrad and "
                         "gtp_remat are not supported on this path; turn them off or leave this layer stock")
    allreduce_dgrad, sequence_parallel = bool(megatron.get("allreduce_dgrad")), bool(megatron.get("sequence_parallel"))
    tp_group = megatron.get("tp_group")
    if tp_group is None and (allreduce_dgrad or sequence_parallel):
        from megatron.core import parallel_state
        tp_group = parallel_state.get_tensor_model_parallel_group()
    return LinearDPWgrad.apply(input, weight, bias, allreduce_dgrad, sequence_parallel, tp_group)


def _linears(module):
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    return [m for m in module.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))
            and getattr(m, "weight", None) is not None and m.weight.requires_grad]


def _why_unfusable(m) -> str | None:
    """Why this linear's backward cannot reach the fused path (checked before DDP is built), or None."""
    if getattr(m, "gradient_accumulation_fusion", False):
        return "its stock forward runs Megatron's fused wgrad (apex); the DP overlap needs it off for this layer"
    if getattr(m.config, "defer_embedding_wgrad_compute", False) and not hasattr(m, "flash_site"):
        return "deferred embedding wgrad (defer_embedding_wgrad_compute)"
    if getattr(m, "gtp_remat_size", 1) != 1 or getattr(m, "explicit_expert_comm", False):
        return "expert / GTP-remat layer"
    if getattr(m, "flash_fp8", None) is not None:
        return "an FP8 layer (the reduce-scatter inside its wgrad has no FP8 GEMM yet)"
    return None


def _dp_groups(ddp_kwargs):
    """(DP group: sets Megatron's default bucket size, DP x CP group: reduce-scatters the gradients)."""
    pgs = ddp_kwargs.get("pg_collection")
    if pgs is not None and getattr(pgs, "dp", None) is not None:
        return pgs.dp, getattr(pgs, "dp_cp", None) or pgs.dp
    from megatron.core import parallel_state as ps
    return ps.get_data_parallel_group(), ps.get_data_parallel_group(with_context_parallel=True)


def _auto_choice(module, ddp_config, ddp_kwargs, tokens, asynchronous) -> tuple[list, bool | None]:
    """The linears to fuse by default (auto_fuse.auto_linears: the cost model where the token count is
    known, else stock's last bucket), explained in one log line, and where their rings run."""
    dp, dp_cp = _dp_groups(ddp_kwargs)
    size = None if ddp_kwargs.get("disable_bucketing") else stock_bucket_size(ddp_config, dp.size())
    picked, line, asynchronous = auto_linears(module, _linears(module), size, dp_cp, tokens, asynchronous)
    log.info("%s", line)
    return picked, asynchronous


def _select(module, linears, ddp_config, ddp_kwargs, tokens=None, asynchronous=None) -> tuple[list, bool | None]:
    """The linears to fuse (explicit, or the automatic choice) less the unfusable ones (one log line), and
    where their rings run (the automatic choice may settle asynchronous=None: auto_fuse.auto_linears)."""
    if linears is None:
        linears, asynchronous = _auto_choice(module, ddp_config, ddp_kwargs, tokens, asynchronous)
    linears = list(linears)
    refused = {tuple(m.weight.shape): _why_unfusable(m) for m in linears if _why_unfusable(m)}
    if refused:
        log.warning("flash DP overlap: %d weight(s) stay on Megatron's bucketed reduce-scatter: %s", len(refused),
                    "; ".join(f"{k}: {v}" for k, v in sorted(refused.items())))
    return [m for m in linears if _why_unfusable(m) is None], asynchronous


def build_with_dp_overlap(build, ddp_config, module, *, linears=None, algo="flash", context=None,
                          tokens=None, asynchronous=None, **ddp_kwargs):
    """`build(**ddp_kwargs)` -> a Megatron DDP of `module`, called with the chosen weights in buckets of their
    own (and 0.19's `full_param_layout` rewritten to match), then marked for the fused reduce-scatter.
    -> (ddp, accepted). wrap_with_dp_overlap and the pretrain() subclass (pretrain.py) both build here."""
    linears, asynchronous = _select(module, linears, ddp_config, ddp_kwargs, tokens, asynchronous)
    weights = [m.weight for m in linears]
    if ddp_kwargs.get("full_param_layout") is not None:
        ddp_kwargs["full_param_layout"] = relayout(ddp_kwargs["full_param_layout"], module, weights, ddp_config)
    with isolated_buckets(module, weights):
        ddp = build(**ddp_kwargs)
    accepted = enable_dp_overlap(ddp, weights, algo=algo, context=context, asynchronous=asynchronous)
    ids = {id(w) for w in accepted}
    for m in linears:
        if id(m.weight) in ids:  # the stock forward of both kinds reaches the fused wgrad through this;
            m._forward_impl = linear_dp_forward_impl  # a Flash layer's own TP walk through its wgrad_fn
    return ddp, accepted


def wrap_with_dp_overlap(config, ddp_config, module, *, linears=None, algo="flash", context=None, tokens=None,
                         asynchronous=None, **ddp_kwargs):
    """Megatron `DistributedDataParallel(config, ddp_config, module, **ddp_kwargs)` whose selected linears
    reduce-scatter their weight gradient over DP inside their wgrad GEMM (stock layers through
    `linear_dp_forward_impl`, the plugin's Flash layers inside their own TP walk, megatron/linear.py).

    linears: None = the automatic choice, logged in one line (megatron/ddp/auto_fuse.py: with `tokens`, the rows
    of a wgrad GEMM (seq x micro-batch; read from Megatron's args when pretrain() set them), a calibrated
    cost model fuses the linears reduced last in backward where stock would leave communication exposed;
    without it, the weights in stock's last bucket), or an explicit list. A precomputed `full_param_layout`
    (megatron-core >= 0.19) is rewritten so that each fused weight has a bucket of its own and every other parameter keeps its bucket (layout.relayout).
    asynchronous: None = the current stream on NCCL; on host-driven transports (gloo) the DP worker thread,
    except at TP = 1 where the automatic choice's cost model finds rings in backward do not stall it
    (auto_fuse.auto_linears); True = the worker (gloo only, any TP size);
    False = each ring inside its own layer's backward.
    Returns (ddp_model, accepted): `accepted` are the weights whose reduce-scatter runs fused; the others
    stay stock (named in one log line)."""
    from megatron.core.distributed import DistributedDataParallel

    return build_with_dp_overlap(lambda **kw: DistributedDataParallel(config, ddp_config, module, **kw),
                                 ddp_config, module, linears=linears, algo=algo, context=context, tokens=tokens,
                                 asynchronous=asynchronous, **ddp_kwargs)
