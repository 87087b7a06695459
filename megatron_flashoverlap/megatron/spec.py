"""Layer spec: Megatron's own local GPT layer spec with our linears in the four TP GEMM sites.

    --spec megatron_flashoverlap.spec flashoverlap_layer        a ModuleSpec: every Megatron path takes it
                                                                (what --flash-overlap puts in args.spec)
    --spec megatron_flashoverlap.spec flashoverlap_layer_spec   0.19's GPTModelBuilder calls it
    flashoverlap_layer_spec(config, vp_stage=None) -> block spec        config: Megatron's model config
                                            (our layers, and our norm as the block's final norm too)
    get_gpt_layer_flashoverlap_spec(num_experts=None, ...) -> ModuleSpec
                                            get_gpt_layer_local_spec's signature, for model providers
    layer_spec(flash_config, qk_layernorm=..., normalization=...)      explicit, for your own model code

The provider (`FlashOverlapSpecProvider`) is Megatron's `LocalSpecProvider` with the column/row linears
replaced by ModuleSpecs of FlashColumnParallelLinear / FlashRowParallelLinear that carry the
FlashOverlapConfig as a constructor parameter; norms, core attention and experts fall back to the local
provider. Works with megatron-core 0.16.x (the MLP spec is a ModuleSpec) through 0.19.x (a
functools.partial of MLP.as_mlp_submodule): both are rebuilt through Megatron's
`get_mlp_module_spec_for_backend` with our provider, so neither shape is touched by hand.

The FlashOverlapConfig of the spec functions is `megatron_flashoverlap.config.active()`: the config the
`--flash-overlap` flag activated at parse time, else the YAML the environment names (config.ENV_VARS), else
the defaults.
Megatron's model config is read for Megatron's own fields only.
"""
from __future__ import annotations

import functools
import warnings

from megatron.core import parallel_state
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_mlp_module_spec_for_backend
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import TransformerLayer

from ..config import LAYERS, FlashOverlapConfig, active
from .linear import FlashColumnParallelLinear, FlashRowParallelLinear
from .norm import SequenceParallelNorm, decoder_block_spec
from .sdpa import core_attention_for
from .attention import select_attention  # core attention: Ulysses for cp > 1, query split when asked
from .moe import check_moe_config, flash_moe_spec


class FlashOverlapSpecProvider(LocalSpecProvider):
    """LocalSpecProvider whose column/row parallel linears are ours, configured by `flash_config`."""

    def __init__(self, flash_config: FlashOverlapConfig | None = None):
        self.flash_config = active() if flash_config is None else flash_config

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
               normalization: str | None = None, qk_l2_norm: bool = False, attention_backend="auto",
               num_experts: int | None = None, moe_grouped_gemm: bool = False) -> ModuleSpec:
    """TransformerLayer spec = get_gpt_layer_local_spec(...) with linear_qkv/proj/fc1/fc2 ours, and the norms
    and core attention of `_norms_and_attention` (attention_backend: Megatron's --attention-backend, an
    AttnBackend or its name; see sdpa.core_attention_for). num_experts: the MLP is Megatron's MoE spec
    (routed experts Megatron's, shared experts' fc1/fc2 ours) in our FlashMoELayer (megatron/moe.py)."""
    provider = FlashOverlapSpecProvider(flash_config)
    spec = get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=moe_grouped_gemm,
                                    qk_layernorm=qk_layernorm, normalization=normalization, qk_l2_norm=qk_l2_norm)
    attention = submodules_of(spec.submodules.self_attention)
    attention.linear_qkv = provider.column_parallel_linear()
    attention.linear_proj = provider.row_parallel_linear()
    _norms_and_attention(spec.submodules, attention, provider.flash_config, qk_layernorm and not qk_l2_norm,
                         attention_backend)
    spec.submodules.mlp = get_mlp_module_spec_for_backend(backend=provider, num_experts=num_experts,
                                                          moe_grouped_gemm=moe_grouped_gemm)
    if num_experts:
        spec.submodules.mlp = flash_moe_spec(spec.submodules.mlp, provider.flash_config)
    return spec


def _norms_and_attention(layer, attention, flash_config: FlashOverlapConfig, qk_norm: bool, backend) -> None:
    """Norms: SequenceParallelNorm (TENorm with TE; builds under SP without apex, RMSNorm included) in the
    slots the local spec fills. Core attention: TE's with TE, else SDPA (norm.py, sdpa.py); a config that is
    `reference` on every layer keeps Megatron's DotProductAttention: that config is the stock local layer, the
    serial baseline of every comparison."""
    layer.input_layernorm = layer.pre_mlp_layernorm = SequenceParallelNorm
    if qk_norm:
        attention.q_layernorm = attention.k_layernorm = SequenceParallelNorm
    if not all(flash_config.plan(name).is_reference for name in LAYERS):
        attention.core_attention = core_attention_for(None, backend)


def _refuse_unsupported(where: str, multi_latent_attention=False) -> None:
    if multi_latent_attention:
        raise ValueError(f"{where}: multi-latent attention is not supported yet; drop --multi-latent-attention "
                         f"or use the stock spec")


def _with_attention(spec: ModuleSpec, flash_config: FlashOverlapConfig, context_parallel_size,
                    sequence_parallel) -> ModuleSpec:
    """What every spec function returns: layer_spec's spec with the core attention the config asks for."""
    select_attention(submodules_of(spec.submodules.self_attention), flash_config,
                     context_parallel_size=context_parallel_size, sequence_parallel=sequence_parallel)
    return spec


def flashoverlap_layer_spec(config, vp_stage: int | None = None) -> TransformerBlockSubmodules:
    """The `--spec` entry point: Megatron calls it with its model config (and vp_stage: the block spec builds
    that stage's layers). Dense and MoE GPT layers (every layer the same). A block spec, so the block's
    final norm is ours too."""
    return decoder_block_spec(_layer_for(config), config, vp_stage)


def _layer_for(config) -> ModuleSpec:
    """The layer spec for Megatron's model config (what every layer of the block gets)."""
    _refuse_unsupported("flashoverlap_layer_spec", getattr(config, "multi_latent_attention", False))
    if getattr(config, "num_moe_experts", None):
        check_moe_config(config)  # flex / --overlap-moe-expert-parallel-comm: refused here, before the build
    flash_config = active()
    spec = layer_spec(flash_config, qk_layernorm=bool(getattr(config, "qk_layernorm", False)),
                      normalization=getattr(config, "normalization", None),
                      qk_l2_norm=bool(getattr(config, "qk_l2_norm", False)),
                      attention_backend=getattr(config, "attention_backend", None) or "auto",  # honoured
                      num_experts=getattr(config, "num_moe_experts", None),
                      moe_grouped_gemm=bool(getattr(config, "moe_grouped_gemm", False)))
    return _with_attention(spec, flash_config, getattr(config, "context_parallel_size", 1) or 1,
                           bool(getattr(config, "sequence_parallel", False)))


def get_gpt_layer_flashoverlap_spec(num_experts=None, moe_grouped_gemm=False, qk_layernorm=False,
                                    multi_latent_attention=False, fp8=None, normalization=None, qk_l2_norm=False,
                                    use_kitchen=False, use_kitchen_attention=False, kitchen_attention_backend="sdpa",
                                    *, moe_use_legacy_grouped_gemm=False, flash_config=None,
                                    sequence_parallel=None, context_parallel_size=None) -> ModuleSpec:
    """Drop-in for megatron-core 0.19's `get_gpt_layer_local_spec` (same arguments, same order; 0.16's
    `moe_use_legacy_grouped_gemm` by keyword): the layer `flashoverlap_layer_spec` builds for the same
    settings. Keyword-only extras: flash_config (default: config.active()), sequence_parallel (needed only
    for query-split attention) and context_parallel_size (default: Megatron's CP group size, else 1).
    MLA, Kitchen and the legacy grouped GEMM are a ValueError; fp8 is ignored, as in the stock function."""
    where = "get_gpt_layer_flashoverlap_spec"
    _refuse_unsupported(where, multi_latent_attention)
    if moe_use_legacy_grouped_gemm:
        raise ValueError(f"{where}: moe_use_legacy_grouped_gemm (0.16's legacy GroupedMLP) is not supported; "
                         f"leave it False (moe_grouped_gemm is taken, as in get_gpt_layer_local_spec)")
    if use_kitchen or use_kitchen_attention:
        raise ValueError(f"{where}: Kitchen replaces the linears/attention with its own; use Megatron's "
                         f"get_gpt_layer_local_spec(use_kitchen=True) instead, or leave use_kitchen* False")
    if fp8 is not None:
        warnings.warn(f"{where}: fp8 is deprecated and ignored (as in get_gpt_layer_local_spec)", stacklevel=2)
    if context_parallel_size is None:
        initialized = parallel_state.model_parallel_is_initialized()
        context_parallel_size = parallel_state.get_context_parallel_world_size() if initialized else 1
    flash_config = active() if flash_config is None else flash_config
    spec = layer_spec(flash_config, qk_layernorm=bool(qk_layernorm), normalization=normalization,
                      qk_l2_norm=bool(qk_l2_norm), num_experts=num_experts, moe_grouped_gemm=bool(moe_grouped_gemm))
    return _with_attention(spec, flash_config, context_parallel_size, sequence_parallel)


class FlashOverlapTransformerLayer(TransformerLayer):
    """A TransformerLayer whose submodules come from `flashoverlap_layer_spec(config)` when it is built
    (config: the layer's TransformerConfig), so one module-level ModuleSpec, `flashoverlap_layer`, serves
    every Megatron path that takes a `--spec` object as it is (legacy gpt_builder, tools/checkpoint,
    --use-checkpoint-args) as well as 0.19's GPTModelBuilder. Same modules, state_dict keys and forward."""

    def __init__(self, config, submodules=None, *args, **kwargs):
        if submodules is None:
            submodules = _layer_for(config).submodules
        super().__init__(config, submodules, *args, **kwargs)


flashoverlap_layer = ModuleSpec(module=FlashOverlapTransformerLayer)


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
    from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules

    full = (get_gpt_layer_local_spec() if stock else layer_spec(flash_config)).submodules
    attention = ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=full.input_layernorm, self_attention=full.self_attention, self_attn_bda=full.self_attn_bda))
    mlp = ModuleSpec(module=MLPLayer, submodules=TransformerLayerSubmodules(
        pre_mlp_layernorm=full.pre_mlp_layernorm, mlp=full.mlp, mlp_bda=full.mlp_bda))
    return ModuleSpec(module=HybridStack, submodules=HybridStackSubmodules(attention_layer=attention, mlp_layer=mlp))
