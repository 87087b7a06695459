"""Layer spec: Megatron's own local GPT layer spec with our linears in the four TP GEMM sites.

    --spec megatron_flashoverlap.spec flashoverlap_layer_spec        (Megatron-LM pretrain scripts)
    flashoverlap_layer_spec(config, vp_stage=None) -> block spec     (config: Megatron's model config)
    layer_spec(flash_config, qk_layernorm=..., normalization=...)   (explicit, for your own model code)

The provider (`FlashOverlapSpecProvider`) is Megatron's `LocalSpecProvider` with the column/row linears
replaced by ModuleSpecs of FlashColumnParallelLinear / FlashRowParallelLinear that carry the
FlashOverlapConfig as a constructor parameter; norms are SequenceParallelNorm (norm.py: SP without apex),
core attention is SDPA or TE's (sdpa.py), experts fall back to the local provider. Works with megatron-core 0.16.x (the MLP spec is a ModuleSpec) through 0.19.x (a
functools.partial of MLP.as_mlp_submodule): both are rebuilt through Megatron's
`get_mlp_module_spec_for_backend` with our provider, so neither shape is touched by hand.

Where the FlashOverlapConfig comes from in `flashoverlap_layer_spec` (first that exists):
  1. `config.flash_overlap_config`: a FlashOverlapConfig or a YAML path (what the launcher sets);
  2. the environment variable FLASHOVERLAP_CONFIG = a YAML path;
  3. the default: `flash` on every site.
"""
from __future__ import annotations

import functools
import os

from megatron.core.models.backends import LocalSpecProvider
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_mlp_module_spec_for_backend
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from ..config import FlashOverlapConfig, load_config
from ..config import LAYERS
from .linear import FlashColumnParallelLinear, FlashRowParallelLinear
from .norm import SequenceParallelNorm, decoder_block_spec
from .sdpa import core_attention_for
from .attention import select_attention  # core attention: Ulysses for cp > 1, query split when asked

ENV_CONFIG = "FLASHOVERLAP_CONFIG"


class FlashOverlapSpecProvider(LocalSpecProvider):
    """LocalSpecProvider whose column/row parallel linears are ours, configured by `flash_config`."""

    def __init__(self, flash_config: FlashOverlapConfig | None = None):
        self.flash_config = flash_config or FlashOverlapConfig()

    def column_parallel_linear(self) -> ModuleSpec:
        return ModuleSpec(module=FlashColumnParallelLinear, params={"flash_config": self.flash_config})

    def row_parallel_linear(self) -> ModuleSpec:
        return ModuleSpec(module=FlashRowParallelLinear, params={"flash_config": self.flash_config})


def submodules_of(spec):
    """The `submodules` of a ModuleSpec (0.16) or of a functools.partial(..., submodules=...) (0.19)."""
    if isinstance(spec, functools.partial):
        return spec.keywords["submodules"]
    return spec.submodules


def layer_spec(flash_config: FlashOverlapConfig | None = None, *, qk_layernorm: bool = False,
               normalization: str | None = None, qk_l2_norm: bool = False) -> ModuleSpec:
    """TransformerLayer spec = get_gpt_layer_local_spec(...) with linear_qkv/proj/fc1/fc2 ours, and the norms
    and core attention of `_norms_and_attention`."""
    provider = FlashOverlapSpecProvider(flash_config)
    spec = get_gpt_layer_local_spec(qk_layernorm=qk_layernorm, normalization=normalization, qk_l2_norm=qk_l2_norm)
    attention = submodules_of(spec.submodules.self_attention)
    attention.linear_qkv = provider.column_parallel_linear()
    attention.linear_proj = provider.row_parallel_linear()
    _norms_and_attention(spec.submodules, attention, provider.flash_config, qk_layernorm and not qk_l2_norm)
    spec.submodules.mlp = get_mlp_module_spec_for_backend(backend=provider)
    return spec


def _norms_and_attention(layer, attention, flash_config: FlashOverlapConfig, qk_norm: bool) -> None:
    """Norms: SequenceParallelNorm (TENorm with TE; builds under SP without apex, RMSNorm included) in the
    slots the local spec fills. Core attention: TE's with TE, else SDPA (norm.py, sdpa.py); a config that is
    `off` on every site keeps Megatron's DotProductAttention: that config is the stock local layer, the
    serial baseline of every comparison."""
    layer.input_layernorm = layer.pre_mlp_layernorm = SequenceParallelNorm
    if qk_norm:
        attention.q_layernorm = attention.k_layernorm = SequenceParallelNorm
    if not all(flash_config.plan(name).stock for name in LAYERS):
        attention.core_attention = core_attention_for(None, "auto")


def flashoverlap_layer_spec(config, vp_stage: int | None = None) -> TransformerBlockSubmodules:
    """The `--spec` entry point: Megatron calls it with its model config (and vp_stage, unused: every
    layer of every virtual stage gets the same spec). Dense GPT layers only."""
    if getattr(config, "num_moe_experts", None):
        raise ValueError("flashoverlap_layer_spec: MoE layers are not supported yet; drop --num-experts or use "
                         "the stock spec")
    if getattr(config, "multi_latent_attention", False):
        raise ValueError("flashoverlap_layer_spec: multi-latent attention is not supported yet; drop "
                         "--multi-latent-attention or use the stock spec")
    flash_config = resolve_flash_config(config)
    spec = layer_spec(flash_config, qk_layernorm=bool(getattr(config, "qk_layernorm", False)),
                      normalization=getattr(config, "normalization", None),
                      qk_l2_norm=bool(getattr(config, "qk_l2_norm", False)))
    select_attention(submodules_of(spec.submodules.self_attention), config, flash_config)
    return decoder_block_spec(spec, config, vp_stage)  # the block's final norm: SequenceParallelNorm too


def resolve_flash_config(config=None) -> FlashOverlapConfig:
    """config.flash_overlap_config (object or YAML path), else $FLASHOVERLAP_CONFIG, else all-flash."""
    chosen = getattr(config, "flash_overlap_config", None) or os.environ.get(ENV_CONFIG)
    if chosen is None:
        return FlashOverlapConfig()
    if isinstance(chosen, FlashOverlapConfig):
        return chosen
    return load_config(chosen)


def hybrid_stack_spec(flash_config: FlashOverlapConfig | None = None, stock: bool = False) -> ModuleSpec:
    """HybridStack spec (megatron-core >= 0.19 HybridModel) for attention ('*') and MLP ('-') layers, made
    of the same local submodules as `layer_spec`: a real norm before each block (Megatron's stock hybrid
    spec fuses it into TE's LayerNormColumnParallelLinear instead) and our linears. `stock=True` gives the
    same stack with Megatron's own linears (the comparison baseline). Mamba/MoE layers are not filled."""
    try:
        from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
        from megatron.core.ssm.mlp_layer import MLPLayer
    except ImportError as err:
        raise ValueError("hybrid_stack_spec needs megatron-core >= 0.19 (HybridModel); use layer_spec with "
                         "GPTModel on older versions") from err
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    full = (get_gpt_layer_local_spec() if stock else layer_spec(flash_config)).submodules
    attention = ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=full.input_layernorm, self_attention=full.self_attention, self_attn_bda=full.self_attn_bda))
    mlp = ModuleSpec(module=MLPLayer, submodules=TransformerLayerSubmodules(
        pre_mlp_layernorm=full.pre_mlp_layernorm, mlp=full.mlp, mlp_bda=full.mlp_bda))
    return ModuleSpec(module=HybridStack, submodules=HybridStackSubmodules(attention_layer=attention, mlp_layer=mlp))
