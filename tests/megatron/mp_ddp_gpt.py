"""Worker bodies: a small Megatron GPT under DDP + DistributedOptimizer, stock vs the flash DP overlap.

`train` builds the same GPT (tiny_config, fixed seed) as
  stock    the stock local spec, Megatron's DistributedDataParallel (bucketed --overlap-grad-reduce);
  flash    our spec (Flash TP linears), DDP through `wrap_with_dp_overlap` (automatic or explicit choice),
           optionally with a precomputed megatron-core 0.19 `full_param_layout`;
trains each for `steps` optimizer steps (micro-batches as Megatron's schedules run them, then Megatron's
finalize_model_grads: finish_grad_sync + the SP norm/bias all-reduce) and returns the parameters, the
fused-call counter of every accepted weight (by name), and the bucket sizes of both.
"""
from __future__ import annotations

import contextlib

import torch

from megatron_flashoverlap.megatron import models as tm
from tests.support.loglines import Lines as _Lines


def _model(mode, tp, sp, layers):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_flashoverlap.megatron.spec import layer_spec

    cfg = tm.tiny_config(tp, sp, num_layers=layers)
    return cfg, tm.build_gpt(cfg, get_gpt_layer_local_spec() if mode == "stock" else layer_spec())


def _ddp(mode, cfg, model, ddp_kw, layout, linears, tokens=None, asynchronous=None):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from megatron_flashoverlap.megatron.ddp.wrap import wrap_with_dp_overlap

    ddp_cfg = DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_grad_reduce=True, **ddp_kw)
    kwargs = {}
    if layout:  # Megatron 0.19's recommended path: the caller computes the layout, DDP takes it
        from megatron.core import parallel_state as ps
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
        params = [p for p in model.parameters() if p.requires_grad]
        kwargs["full_param_layout"] = DistributedOptimizer.compute_full_param_layout(
            params, ddp_cfg.bucket_size, ps.get_data_parallel_world_size(), ddp_cfg)
    if mode == "stock":
        return DistributedDataParallel(cfg, ddp_cfg, model, **kwargs), []
    chosen = None if linears is None else [m for n, m in model.named_modules() if n.endswith(tuple(linears))]
    return wrap_with_dp_overlap(cfg, ddp_cfg, model, linears=chosen, tokens=tokens, asynchronous=asynchronous,
                                **kwargs)


def _step(ddp, opt, micro, seed):
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    ddp.zero_grad_buffer()
    opt.zero_grad()
    for m in range(micro):
        with ddp.no_sync() if m < micro - 1 else contextlib.nullcontext():
            (tm.gpt_loss(ddp, tm.batch(seed * 10 + m)) / micro).backward()
    finalize_model_grads([ddp])
    opt.step()


def _run(mode, tp, sp, layers, steps, micro, ddp_kw, layout, linears, tokens=None, asynchronous=None):
    from megatron.core import parallel_state as ps
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    cfg, model = _model(mode, tp, sp, layers)
    ddp, accepted = _ddp(mode, cfg, model, dict(ddp_kw), layout, linears, tokens, asynchronous)
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = get_megatron_optimizer(OptimizerConfig(use_distributed_optimizer=True, optimizer="adam", lr=10.0,
                                                 adam_eps=100.0, clip_grad=0.0), [ddp])
    dp_rank = ps.get_data_parallel_rank()
    for step in range(steps):
        _step(ddp, opt, micro, seed=100 * step + dp_rank)  # data differ per DP rank, agree across TP
    names = {id(p): n for n, p in model.named_parameters()}
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "fused": {names[id(w)]: w._flashoverlap_dp.fused_calls for w in accepted},
            "asynchronous": sorted({w._flashoverlap_dp.asynchronous for w in accepted}),
            "buckets": [bk.grad_data.numel() for buf in ddp.buffers for bk in buf.buckets],
            "moves": {n: (p.detach() - init[n]).abs().max().item() for n, p in model.named_parameters()}}


@contextlib.contextmanager
def _fixed_rates(rates):
    """rates (comm_s, ring_s, gemm_s, ring_lat_s) or None: the cost model's calibration (megatron/ddp/auto_fuse.calibrate,
    a timing of this machine) replaced by these numbers, so its choice is known in advance; None: measured."""
    from megatron_flashoverlap.megatron.ddp import auto_fuse as ddp_choice
    from megatron_flashoverlap.plan.dp import Rates

    if rates is None:
        yield
        return
    measured = ddp_choice.calibrate
    ddp_choice.calibrate = lambda dp_group, tokens, **kw: Rates(*rates, hops=dp_group.size() - 1)
    try:
        yield
    finally:
        ddp_choice.calibrate = measured


def train(rank, world, tp=2, sp=True, layers=2, steps=3, micro=2, ddp_kw=None, layout=False, linears=None,
          tokens=None, asynchronous=None, rates=None):
    """-> {"stock": ..., "flash": ..., "log": [ddp + ddp_linear lines], "dp": DP size} (module docstring).
    rates: fixed cost-model rates (_fixed_rates) instead of the calibration."""
    from megatron.core import parallel_state as ps

    from megatron_flashoverlap.megatron.ddp import grad_sync as megatron_ddp, wrap as ddp_linear

    tm.init_tp(tp)
    lines = _Lines()
    for lg in (megatron_ddp.log, ddp_linear.log):
        lg.addHandler(lines)
    old = ddp_linear.log.level
    ddp_linear.log.setLevel("INFO")
    try:
        with _fixed_rates(rates):
            out = {mode: _run(mode, tp, sp, layers, steps, micro, ddp_kw or {}, layout, linears, tokens,
                              asynchronous) for mode in ("stock", "flash")}
        out.update(log=lines.lines, dp=ps.get_data_parallel_world_size())
        return out
    finally:
        ddp_linear.log.setLevel(old)
        for lg in (megatron_ddp.log, ddp_linear.log):
            lg.removeHandler(lines)
        tm.destroy()
