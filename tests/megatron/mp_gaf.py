"""Worker bodies: gradient_accumulation_fusion=True in our layers, under Megatron's DistributedDataParallel.

`main_grads` builds three tiny GPTs from one seed: ours with the fusion on, ours with it off, and the
stock local spec with it off; wraps each in Megatron's DDP (fp32 grad buffers) and runs micro-batches as
Megatron's schedules do (all but the last under no_sync, then finish_grad_sync). It returns every
parameter's main_grad after the first and after the last micro-batch, what autograd left in `.grad`,
and `grad_added_to_main_grad` of our linears' weights.

The GPT's output layer is Megatron's own ColumnParallelLinear, which cannot take the fusion without apex
(its constructor raises; on CPU there is no apex). For the fusion-on models it is built here with the
flag off (`_UnfusedOutputLayer`): its dW goes to .grad and DDP adds it into main_grad, as with
--no-gradient-accumulation-fusion. Our layers see the fusion on and no apex, as on a CPU run.
"""
from __future__ import annotations

import contextlib
import copy
import logging

import torch

from megatron_flashoverlap.megatron import models as tm
from tests.support.loglines import Lines as _Lines

LINEARS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


@contextlib.contextmanager
def _output_layer_unfused():
    """While a GPTModel is built: its output layer (looked up as tensor_parallel.ColumnParallelLinear)
    gets the config with gradient_accumulation_fusion off (module docstring)."""
    from megatron.core import tensor_parallel

    stock = tensor_parallel.ColumnParallelLinear

    class _UnfusedOutputLayer(stock):
        def __init__(self, *args, config, **kwargs):
            unfused = copy.copy(config)
            unfused.gradient_accumulation_fusion = False
            super().__init__(*args, config=unfused, **kwargs)

    tensor_parallel.ColumnParallelLinear = _UnfusedOutputLayer
    try:
        yield
    finally:
        tensor_parallel.ColumnParallelLinear = stock


def _gpt(tp, sp, spec_kind, fusion, flash):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_flashoverlap.config import from_dict
    from megatron_flashoverlap.megatron.spec import layer_spec

    cfg = tm.tiny_config(tp, sp)
    cfg.gradient_accumulation_fusion = fusion
    spec = get_gpt_layer_local_spec() if spec_kind == "stock" else layer_spec(from_dict(flash))
    with _output_layer_unfused() if fusion else contextlib.nullcontext():
        model = tm.build_gpt(cfg, spec)
    return cfg, model


def _ddp(cfg, model, dist_opt):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=dist_opt,
                                            overlap_grad_reduce=dist_opt)
    return DistributedDataParallel(cfg, ddp_cfg, model)


def _grads(model):
    return {n: p.main_grad.detach().clone() for n, p in model.named_parameters()}


def _micro_batches(ddp, model, micro):
    """Megatron's schedule: zero the buffers, no_sync for all but the last micro-batch, then finish."""
    ddp.zero_grad_buffer()
    snaps, grads_left = [], 0
    for m in range(micro):
        with ddp.no_sync() if m < micro - 1 else contextlib.nullcontext():
            tm.gpt_loss(ddp, tm.batch(m)).backward()
        grads_left += sum(p.grad is not None for p in model.parameters())
        if m == 0:
            snaps.append(_grads(model))
    ddp.finish_grad_sync()
    snaps.append(_grads(model))
    return snaps, grads_left


def _flags(model):
    return {n: bool(p.grad_added_to_main_grad) for n, p in model.named_parameters()
            if any(k in n for k in LINEARS) and n.endswith("weight")}


def _run(tp, sp, spec_kind, fusion, flash, dist_opt, micro):
    cfg, model = _gpt(tp, sp, spec_kind, fusion, flash)
    ddp = _ddp(cfg, model, dist_opt)
    snaps, grads_left = _micro_batches(ddp, model, micro)
    return {"snaps": snaps, "grads_left": grads_left, "flags": _flags(model),
            "config_kept": cfg.gradient_accumulation_fusion == fusion}


def _rel(a, b):
    scale = b.double().abs().max().item()
    diff = (a.double() - b.double()).abs().max().item()
    return diff / scale if scale else diff


def _worst(x, y):
    """-> per snapshot: (the parameter with the largest relative main_grad difference, that difference)."""
    return [max(((n, _rel(a[n], b[n])) for n in a), key=lambda kv: kv[1]) for a, b in zip(x["snaps"], y["snaps"])]


def main_grads(rank, world, sp, dist_opt, flash=None, micro=3):
    """-> worst differences on/off and off/stock, grads left, flags, and the stock-forward log lines."""
    from megatron_flashoverlap.megatron import linear

    flash = flash or {"default": {"algo": "flash"}}
    tm.init_tp(world)
    linear._LOGGED.clear()  # the stock-forward lines are logged once per process: this run must see them
    lines = _Lines()
    linear.log.addHandler(lines)
    linear.log.setLevel(logging.INFO)
    try:
        on, off, stock = (_run(world, sp, kind, fusion, flash, dist_opt, micro)
                          for kind, fusion in (("ours", True), ("ours", False), ("stock", False)))
        return {"on_vs_off": _worst(on, off), "off_vs_stock": _worst(off, stock), "on_vs_stock": _worst(on, stock),
                "grads_left": (on["grads_left"], off["grads_left"]), "flags": (on["flags"], off["flags"]),
                "config_kept": on["config_kept"], "nonzero": all(g.abs().max() > 0 for g in on["snaps"][0].values()),
                "log": lines.lines}
    finally:
        linear.log.removeHandler(lines)
        tm.destroy()


def _fused_layers(world):
    """(config, fc1 column, fc2 row): both Flash layers built with gradient_accumulation_fusion=True (no apex)."""
    from megatron_flashoverlap.megatron.linear import FlashColumnParallelLinear, FlashRowParallelLinear

    from megatron_flashoverlap.config import from_dict

    cfg = tm.tiny_config(world, True)
    cfg.gradient_accumulation_fusion = True
    ours = from_dict({"default": {"algo": "flash"}})  # our operators, whatever auto would measure
    col = FlashColumnParallelLinear(32, 64, config=cfg, init_method=cfg.init_method, bias=True, flash_config=ours,
                                    gather_output=False, tp_comm_buffer_name="fc1")
    row = FlashRowParallelLinear(64, 32, config=cfg, init_method=cfg.init_method, bias=True, flash_config=ours,
                                 input_is_parallel=True, skip_bias_add=True, tp_comm_buffer_name="fc2")
    return cfg, col, row


def build_with_fusion(rank, world):
    """Both Flash layers built with gradient_accumulation_fusion=True (no apex): -> what they kept."""
    tm.init_tp(world)
    try:
        cfg, col, row = _fused_layers(world)
        return {"config_is_shared": col.config is cfg and row.config is cfg,
                "config_flag": cfg.gradient_accumulation_fusion,
                "ours": (col.flash_fuse_wgrad, row.flash_fuse_wgrad),
                "stock_forward": (col.gradient_accumulation_fusion, row.gradient_accumulation_fusion)}
    finally:
        tm.destroy()


def no_main_grad(rank, world):
    """Fusion on, no DDP wrapper (no main_grad), a forward with grad -> the ValueError text."""
    tm.init_tp(world)
    try:
        col = _fused_layers(world)[1]
        x = torch.randn(8, 2, 32)
        with torch.no_grad():
            col(x)  # inference needs no main_grad
        try:
            col(x)
        except ValueError as err:
            return str(err)
        return None
    finally:
        tm.destroy()
