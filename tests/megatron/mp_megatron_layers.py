"""Worker-side bodies of the layer-contract tests: our linears built beside Megatron's stock ones."""
from __future__ import annotations

import inspect

import torch

from megatron_flashoverlap.megatron import models as tm

_PARAM_ATTRS = ("tensor_model_parallel", "partition_dim", "partition_stride", "sequence_parallel", "allreduce",
                "expert_tp", "is_qkv")
_SKIP_ATTRS = {"_parameters", "_buffers", "_modules", "_forward_hooks", "_forward_pre_hooks", "_backward_hooks",
               "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_state_dict_hooks",
               "_load_state_dict_post_hooks", "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs",
               "_forward_hooks_always_called", "_backward_pre_hooks", "_non_persistent_buffers_set",
               "config", "tp_group", "_is_full_backward_hook"}


def _pair(kind, tp, sp, skip_bias_add, site):
    """(stock, ours) of one kind built from the same seed with Megatron's own call-site arguments."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    from megatron_flashoverlap.config import FlashOverlapConfig
    from megatron_flashoverlap.megatron.linear import FlashColumnParallelLinear, FlashRowParallelLinear

    cfg = tm.tiny_config(tp, sp)
    h, n = cfg.hidden_size, cfg.ffn_hidden_size
    common = dict(config=cfg, init_method=cfg.init_method, bias=True, skip_bias_add=skip_bias_add,
                  is_expert=False, tp_comm_buffer_name=site)
    if kind == "column":
        classes, sizes, extra = (ColumnParallelLinear, FlashColumnParallelLinear), (h, n), {"gather_output": False}
    else:
        classes, sizes, extra = (RowParallelLinear, FlashRowParallelLinear), (n, h), {"input_is_parallel": True}
    built = []
    for cls in classes:
        torch.manual_seed(3)
        kw = {**common, **extra, **({"flash_config": FlashOverlapConfig()} if cls in classes[1:] else {})}
        built.append(cls(*sizes, **kw))
    return built


def _attrs(module):
    return {k: v for k, v in vars(module).items() if k not in _SKIP_ATTRS and not k.startswith("flash_")
            and not k.startswith("_flash")}


def _param_view(module):
    return [(n, tuple(p.shape), p.dtype, tuple(getattr(p, a, None) for a in _PARAM_ATTRS))
            for n, p in module.named_parameters()]


def _accepts_all(stock_cls, our_cls) -> bool:
    """Every stock ctor parameter is a named parameter of ours, or ours takes **kwargs."""
    ours = inspect.signature(our_cls.__init__).parameters
    var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in ours.values())
    return all(name in ours or var_kw for name in inspect.signature(stock_cls.__init__).parameters)


def contract(rank, world, kind, sp, skip_bias_add, site):
    """Stock vs ours: params, param attributes, module attributes, ctor, forward/backward, sharded keys."""
    tm.init_tp(world)
    try:
        stock, ours = _pair(kind, world, sp, skip_bias_add, site)
        out = {"params": _param_view(stock) == _param_view(ours),
               "values": all(torch.equal(p, q) for p, q in zip(stock.parameters(), ours.parameters())),
               "attrs": _attrs(stock) == _attrs(ours), "accepts": _accepts_all(type(stock).__mro__[0],
                                                                               type(ours)),
               "backward_dw": (getattr(stock, "backward_dw", lambda: None)(), ours.backward_dw()), "sharded": _sharded(stock) == _sharded(ours)}
        out.update(_run(stock, ours, kind, sp, world))
        return out
    finally:
        tm.destroy()


def _run(stock, ours, kind, sp, world):
    """Forward + backward on the same input; -> shapes, bias identity, max abs errors (param grads: relative)."""
    g = torch.Generator().manual_seed(11)
    s = tm.SEQ // world if (sp and kind == "column") else tm.SEQ
    width = stock.input_size if kind == "column" else stock.input_size_per_partition
    x = torch.randn(s, 2, width, generator=g)
    res = {}
    outs = []
    for m in (stock, ours):
        xi = x.clone().requires_grad_()
        y, b = m(xi)
        (y.square().sum() + (b.sum() if b is not None else 0)).backward()
        outs.append((y, b, xi.grad, [p.grad for p in m.parameters()]))
    (ys, bs, dxs, gs), (yo, bo, dxo, go) = outs
    res["shapes"] = (tuple(ys.shape), tuple(yo.shape))
    res["bias_is_param"] = (bs is stock.bias, bo is ours.bias)
    res["y_err"] = (ys - yo).abs().max().item()
    res["dx_err"] = (dxs - dxo).abs().max().item()
    res["grad_rel"] = max(((a - b).abs().max() / a.abs().max()).item() for a, b in zip(gs, go))
    return res


def _sharded(module):
    from megatron.core import parallel_state

    meta = {"dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True)}
    sd = module.sharded_state_dict(prefix="x.", metadata=meta)
    return sorted((k, tuple(getattr(v, "global_shape", ())), getattr(v, "axis_fragmentations", None))
                  for k, v in sd.items())


def grad_accum_fusion_refused(rank, world):
    """A Flash row layer on an SP site with gradient_accumulation_fusion=True -> the ValueError text."""
    from megatron_flashoverlap.megatron.linear import FlashRowParallelLinear

    tm.init_tp(world)
    try:
        cfg = tm.tiny_config(world, True)
        cfg.gradient_accumulation_fusion = True
        try:
            FlashRowParallelLinear(64, 32, config=cfg, init_method=cfg.init_method, bias=True,
                                   input_is_parallel=True, skip_bias_add=True, tp_comm_buffer_name="fc2")
        except ValueError as err:
            return str(err)
        return None
    finally:
        tm.destroy()


def spec_config_sources(rank, world, bad_path):
    """resolve_flash_config from $FLASHOVERLAP_CONFIG and from config.flash_overlap_config (a bad file)."""
    import os
    from types import SimpleNamespace

    from megatron_flashoverlap.megatron.spec import ENV_CONFIG, resolve_flash_config

    old = os.environ.get(ENV_CONFIG)
    os.environ[ENV_CONFIG] = "configs/slicing.yaml"
    try:
        from_env = resolve_flash_config(None).plan("fc2").algo
    finally:
        os.environ.pop(ENV_CONFIG) if old is None else os.environ.__setitem__(ENV_CONFIG, old)
    default = resolve_flash_config(SimpleNamespace()).plan("fc2").algo
    try:
        resolve_flash_config(SimpleNamespace(flash_overlap_config=bad_path))
        bad = None
    except ValueError as err:
        bad = str(err)
    return from_env, default, bad


def spec_refusals(rank, world):
    """flashoverlap_layer_spec on MoE / MLA configs -> the ValueError texts."""
    from types import SimpleNamespace

    from megatron_flashoverlap.megatron.spec import flashoverlap_layer_spec

    msgs = []
    for cfg in (SimpleNamespace(num_moe_experts=8), SimpleNamespace(multi_latent_attention=True)):
        try:
            flashoverlap_layer_spec(cfg)
            msgs.append(None)
        except ValueError as err:
            msgs.append(str(err))
    return msgs


def cpu_shims(rank, world):
    """enable() twice, then what Megatron's CUDA-assuming helpers give on this CPU process."""
    from megatron.core.transformer import utils

    from megatron_flashoverlap.megatron import cpu

    return (cpu.enable(), cpu.enable(), cpu.is_enabled(), torch.cuda.is_available(),
            str(utils.get_default_causal_mask(3).device), str(torch.cuda.current_device()))
