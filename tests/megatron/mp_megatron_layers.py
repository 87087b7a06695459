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


def _pair(kind, tp, sp, skip_bias_add, site, flash=None):
    """(stock, ours) of one kind built from the same seed with Megatron's own call-site arguments; ours with
    the config `flash` (a YAML mapping; None: the defaults)."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    from megatron_flashoverlap.config import from_dict, uniform
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
        ours = uniform("flash") if flash is None else from_dict(flash)  # flash: the default, auto, measures
        kw = {**common, **extra, **({"flash_config": ours} if cls in classes[1:] else {})}
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


def contract(rank, world, kind, sp, skip_bias_add, site, flash=None):
    """Stock vs ours: params, param attributes, module attributes, ctor, forward/backward, sharded keys; and
    what the chooser decided for ours ({word: (pick, source)})."""
    tm.init_tp(world)
    try:
        stock, ours = _pair(kind, world, sp, skip_bias_add, site, flash)
        out = {"params": _param_view(stock) == _param_view(ours),
               "values": all(torch.equal(p, q) for p, q in zip(stock.parameters(), ours.parameters())),
               "attrs": _attrs(stock) == _attrs(ours), "accepts": _accepts_all(type(stock).__mro__[0],
                                                                               type(ours)),
               "backward_dw": (getattr(stock, "backward_dw", lambda: None)(), ours.backward_dw()), "sharded": _sharded(stock) == _sharded(ours)}
        out.update(_run(stock, ours, kind, sp, world))
        out["decided"] = {k.word: (c.pick, c.source) for k, c in ours.flash_chooser.decided.items()}
        out["ran_hop_chunks"] = sorted({getattr(p, "hop_chunks", None) or 1 for p in ours._flash_trained.values()
                                        if p is not None})  # the plans the layer ran (auto only; stock: none)
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


def spec_equivalence(rank, world, qk_layernorm, normalization, query_split):
    """Three ways to our layer for the same settings: flashoverlap_layer_spec(config),
    get_gpt_layer_flashoverlap_spec(...) and the module-level ModuleSpec flashoverlap_layer -> their GPT
    models' state_dict keys/shapes, whether the logits are equal, the core attention and q-norm classes."""
    from megatron_flashoverlap import config as fc
    from megatron_flashoverlap.megatron import spec as sp

    tm.init_tp(world)
    previous = fc.activate(fc.from_dict({"attention": {"query_split": query_split}}))
    try:
        cfg = tm.tiny_config(world, True, qk_layernorm=qk_layernorm, normalization=normalization)
        specs = {"config": sp.flashoverlap_layer_spec(cfg),
                 "signature": sp.get_gpt_layer_flashoverlap_spec(qk_layernorm=qk_layernorm,
                                                                 normalization=normalization, sequence_parallel=True),
                 "module_spec": sp.flashoverlap_layer}
        models = {k: tm.build_gpt(cfg, spec, seed=5) for k, spec in specs.items()}
        data = tm.batch(1)
        with torch.no_grad():
            logits = {k: tm.gpt_logits(m, data) for k, m in models.items()}
        attention = {k: m.decoder.layers[0].self_attention for k, m in models.items()}
        return {"keys": {k: [(n, tuple(t.shape)) for n, t in m.state_dict().items() if t is not None]
                         for k, m in models.items()},
                "logits_equal": all(torch.equal(logits["config"], v) for v in logits.values()),
                "core_attention": {k: type(a.core_attention).__name__ for k, a in attention.items()},
                "q_layernorm": {k: type(a.q_layernorm).__name__ for k, a in attention.items()}}
    finally:
        fc.activate(previous)
        tm.destroy()


def nosp_chunks_and_timeout(rank, world, chunk_counts=(1, 3)):
    """A row layer without SP (matmul_all_reduce) under configs that differ only in all_reduce.num_chunks
    (and timeout_s): the P2P sends one forward issues, per chunk count, and its context's wait timeout; the
    error of a config naming a calibration table that does not exist."""
    from megatron_flashoverlap import config as fc
    from megatron_flashoverlap.megatron.linear import FlashRowParallelLinear
    from tests.support import profile

    tm.init_tp(world)
    try:
        cfg = tm.tiny_config(world, False)
        sends, timeouts = {}, {}
        for chunks in chunk_counts:
            flash = fc.from_dict({"default": {"algo": "flash"}, "all_reduce": {"num_chunks": chunks},
                                  "timeout_s": 40 + chunks})
            layer = FlashRowParallelLinear(64, 32, config=cfg, init_method=cfg.init_method, bias=True,
                                           input_is_parallel=True, skip_bias_add=True, tp_comm_buffer_name="fc2",
                                           flash_config=flash)
            x = torch.randn(tm.SEQ, 2, 64 // world)
            layer(x)  # warm-up: the once-per-shape peer check
            sends[chunks] = profile.comm_ops(lambda: layer(x)).get("send", 0)
            timeouts[chunks] = layer.flash_context.timeout.total_seconds()
        try:
            FlashRowParallelLinear(64, 32, config=cfg, init_method=cfg.init_method, bias=True, input_is_parallel=True,
                                   skip_bias_add=True, tp_comm_buffer_name="fc2",
                                   flash_config=fc.from_dict({"all_reduce": {"table": "no/such.json"}}))
            missing = None
        except ValueError as err:
            missing = str(err)
        return sends, timeouts, missing
    finally:
        tm.destroy()


def cpu_shims(rank, world):
    """enable() twice, then what Megatron's CUDA-assuming helpers give on this CPU process."""
    from megatron.core.transformer import utils

    from megatron_flashoverlap.megatron import cpu

    return (cpu.enable(), cpu.enable(), cpu.is_enabled(), torch.cuda.is_available(),
            str(utils.get_default_causal_mask(3).device), str(torch.cuda.current_device()))
