"""Worker-side bodies of tests/megatron/test_structure.py: one pipeline stage's decoder block, built from stock's
per-layer block spec and from ours, as the rank's stage sees it (PP, VP stages, layouts, uneven first stage).
"""
from __future__ import annotations

import torch

from megatron_flashoverlap.megatron import models as tm


def _init(pp: int, vpp: int | None, ep: int = 1) -> None:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_flashoverlap.megatron import cpu

    cpu.enable()
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp,
                                             expert_model_parallel_size=ep)
    model_parallel_cuda_manual_seed(1)


def moe_config(pp: int = 1, vpp: int | None = None, ep: int = 1, **kw):
    """A tiny fp32 MoE config (4 experts, top-2, alltoall); `kw` sets the structure (moe_layer_freq, ...)."""
    base = {"num_moe_experts": 4, "moe_router_topk": 2, "moe_token_dispatcher_type": "alltoall",
            "moe_ffn_hidden_size": 32, "add_bias_linear": False, "expert_model_parallel_size": ep,
            "pipeline_model_parallel_size": pp, "virtual_pipeline_model_parallel_size": vpp,
            "pipeline_dtype": torch.float32 if pp > 1 else None}
    return tm.tiny_config(1, False, **{**base, **kw})


def _block(cfg, spec, vp_stage):
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.transformer_block import TransformerBlock

    torch.manual_seed(3)
    block = TransformerBlock(cfg, spec, vp_stage=vp_stage)
    return {"params": [(n, tuple(p.shape)) for n, p in block.named_parameters()],
            "count": sum(p.numel() for p in block.parameters()),
            "layers": [(layer.layer_number, isinstance(layer.mlp, MoELayer)) for layer in block.layers]}


def stage_blocks(rank, world, pp, vpp, kw):
    """Per VP stage of this rank: {"stock" | "block" | "module": params, count, (layer number, is MoE)}.
    stock: get_gpt_decoder_block_spec; block: flashoverlap_layer_spec(config, vp_stage); module: the ModuleSpec
    flashoverlap_layer (what --flash-overlap puts in args.spec; each layer picks its kind when built)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from megatron_flashoverlap.megatron.spec import flashoverlap_layer, flashoverlap_layer_spec

    _init(pp, vpp)
    try:
        cfg = moe_config(pp, vpp, **kw)
        out = []
        for vp_stage in ([None] if vpp is None else range(vpp)):
            specs = {"stock": get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, vp_stage=vp_stage),
                     "block": flashoverlap_layer_spec(cfg, vp_stage=vp_stage), "module": flashoverlap_layer}
            out.append({name: _block(cfg, spec, vp_stage) for name, spec in specs.items()})
        return out
    finally:
        tm.destroy()
