"""One Megatron MoE layer (alltoall dispatcher, EP = the world, TP = expert-TP = 1, SequentialMLP) from stock's
spec or ours, and one timed pass of it: what benchmarks/moe and the planner's one-window run measure.

    layer(cfg, world, method, ffn, flash_config=None)   decoder.layers[0].mlp of a 1-layer MoE GPT
        cfg: {"tokens", "hidden", "ffn", "experts", "topk"}; method "stock" or a moe.algo word
    call(layer, x, mode, fake=None) -> seconds   one forward (+ backward) on x [tokens, 1, h]; `fake`: the
        dispatcher's ep_group swapped for a fake process group for the call (the exchanges move nothing)
Megatron's parallel state must be up (initialize_model_parallel(expert_model_parallel_size=world)).
"""
from __future__ import annotations

import contextlib

import torch

from megatron_flashoverlap.runtime.timing import pass_seconds


def layer(cfg: dict, world: int, method: str, ffn: int, flash_config=None):
    """The MoE layer (decoder.layers[0].mlp) of a 1-layer MoE GPT from stock's or our spec, expert ffn `ffn`."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_flashoverlap.config import from_dict
    from megatron_flashoverlap.megatron import models as tm
    from megatron_flashoverlap.megatron.spec import get_gpt_layer_flashoverlap_spec

    config = tm.tiny_config(1, False, num_layers=1, hidden=cfg["hidden"], heads=4, ffn=cfg["ffn"],
                            num_moe_experts=cfg["experts"], moe_router_topk=cfg["topk"],
                            moe_token_dispatcher_type="alltoall", expert_model_parallel_size=world,
                            moe_ffn_hidden_size=ffn, add_bias_linear=False, moe_aux_loss_coeff=0.0)
    if method == "stock":
        spec = get_gpt_layer_local_spec(num_experts=cfg["experts"])
    else:
        spec = get_gpt_layer_flashoverlap_spec(num_experts=cfg["experts"], flash_config=flash_config or
                                               from_dict({"moe": {"algo": method}}))
    return tm.build_gpt(config, spec).decoder.layers[0].mlp


@contextlib.contextmanager
def _free_exchange(layer, fake):
    """The layer's EP exchanges on `fake` (transfers complete at once) for the duration of the block."""
    disp = layer.token_dispatcher
    real, disp.ep_group = disp.ep_group, fake
    try:
        yield
    finally:
        disp.ep_group = real


def call(layer, x: torch.Tensor, mode: str, fake=None) -> float:
    """Seconds of one forward (+ backward) of `layer` on x [tokens, 1, h] (fresh leaf; grads dropped)."""
    with _free_exchange(layer, fake) if fake is not None else contextlib.nullcontext():
        return pass_seconds(lambda t: layer(t)[0], x, mode, params=list(layer.parameters()))
