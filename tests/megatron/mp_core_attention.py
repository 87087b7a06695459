"""Worker bodies for test_core_attention.py: a tiny real GPTModel from flashoverlap_layer_spec(config) (the
--flash-overlap spec) vs Megatron's own local spec, same weights, same batch; every body destroys the
model-parallel state in a `finally` (the pools are shared between test files)."""
from __future__ import annotations

import torch

from megatron_flashoverlap.megatron import models as tm
from tests.megatron.mp_sdpa import warnings_logged


def _config(tp, sp, dtype, **kw):
    """A tiny GPT config for `dtype`; transformer_impl local, as Megatron-LM's --transformer-impl local."""
    from megatron.core.transformer import TransformerConfig

    half = {"bf16": True} if dtype == torch.bfloat16 else {}
    return TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                             tensor_model_parallel_size=tp, sequence_parallel=sp, use_cpu_initialization=True,
                             params_dtype=dtype, hidden_dropout=0.0, attention_dropout=0.0,
                             gradient_accumulation_fusion=False, transformer_impl="local", **half, **kw)


# The chooser measures nothing (budget 0): every `auto` site keeps stock. On these tiny models the paired rounds
# are host noise (ours "won" 4 of 5 at three sites in a CI run), and a bitwise comparison must not hang on them.
KEEP_STOCK = {"choices": {"budget_s": 0}}


def _ours(cfg, attention: dict | None):
    """flashoverlap_layer_spec(cfg) under the default config with KEEP_STOCK (attention: the YAML's attention
    section)."""
    from megatron_flashoverlap import config as fc
    from megatron_flashoverlap.megatron.spec import flashoverlap_layer_spec

    previous = fc.activate(fc.from_dict({**KEEP_STOCK, **({"attention": attention} if attention else {})},
                                        fc.Environment()))
    try:
        return flashoverlap_layer_spec(cfg)
    finally:
        fc.activate(previous)


def _build(cfg, spec):
    """As Megatron-LM trains a bf16 / fp16 model: the GPTModel inside Float16Module (casts the weights and the
    first stage's input to the 16-bit type, the output back to fp32)."""
    from megatron.core.transformer.module import Float16Module

    model = tm.build_gpt(cfg, spec)
    return Float16Module(cfg, model) if cfg.bf16 or cfg.fp16 else model


def _loss_and_grads(model, data):
    loss = tm.gpt_loss(model, data)
    loss.backward()
    tm.allreduce_sequence_parallel_grads(model)
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def _layer(model):
    return getattr(model, "module", model).decoder.layers[0]


def gpt_vs_stock(rank, world, tp, sp, dtype="bfloat16", attention=None, **config_kw):
    """Same weights, same batch -> {loss_equal, differing grads, core attention classes, our log lines}."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    tm.init_tp(tp)
    try:
        cfg = _config(tp, sp, getattr(torch, dtype), **config_kw)
        with warnings_logged() as logged:
            stock, ours = _build(cfg, get_gpt_layer_local_spec()), _build(cfg, _ours(cfg, attention))
            tm.copy_weights(ours, stock)
            data = tm.batch(0)
            (loss_s, grads_s), (loss_o, grads_o) = _loss_and_grads(stock, data), _loss_and_grads(ours, data)
        return {"loss": [loss_s.item(), loss_o.item()], "loss_equal": torch.equal(loss_s, loss_o),
                "grads_differ": sorted(n for n in grads_s if not torch.equal(grads_s[n], grads_o[n])),
                "n_grads": len(grads_s),
                "logged": [ln for ln in logged if not ln.startswith("flash-overlap chose")],  # auto's decisions
                "chose": [ln for ln in logged if ln.startswith("flash-overlap chose")],
                "core": [type(_layer(m).self_attention.core_attention).__name__ for m in (stock, ours)],
                "proj": type(_layer(ours).self_attention.linear_proj).__name__}
    finally:
        tm.destroy()
