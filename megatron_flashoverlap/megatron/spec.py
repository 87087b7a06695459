"""Layer spec: Megatron's own local GPT layer spec with our linears in the four TP GEMM sites.

    --spec megatron_flashoverlap.spec flashoverlap_layer        a ModuleSpec: every Megatron path takes it
                                                                (what --flash-overlap puts in args.spec)
    --spec megatron_flashoverlap.spec flashoverlap_layer_spec   0.19's GPTModelBuilder calls it
    flashoverlap_layer_spec(config, vp_stage=None) -> block spec        config: Megatron's model config
                                            (per layer as stock's get_gpt_decoder_block_spec: dense or MoE by
                                            --moe-layer-freq, this pipeline stage's layers; our norm as the
                                            block's final norm too; what it cannot build is refused: config/refusals.py)
    model_layer_specs(config) -> [layer spec] * num_layers     the model's layers, before stage slicing
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

How stock reads --moe-layer-freq, for our spec to build the same layer kinds. Reads Megatron's model config
(a TransformerConfig, 0.19's GPTModelConfig proxying one, or parsed args) by attribute name only.

    moe_layer_pattern(config) -> [bool] * num_layers    True where the layer is MoE: stock's reading of
                                                         --moe-layer-freq (get_gpt_decoder_layer_specs); all
                                                         False without experts (stock builds dense layers)

Honoured as stock (built by Megatron's own code or sliced with Megatron's own functions): --moe-layer-freq
(per-layer dense / MoE), --num-layers-in-first/last-pipeline-stage, --pipeline-model-parallel-layout,
account_for_embedding/loss_in_pipeline_split and vp_stage (norm.stage_layer_ids), --mtp-num-layers (Megatron's
GPT builders build MTP layers from their own local spec whatever --spec says: stock linears, named so in the
GEMM sites line), --no-rope-freq / --window-attn-skip-freq (read by the layers themselves). What the spec
refuses is a row of config/refusals.py (the spec check).
"""
from __future__ import annotations

import dataclasses
import functools
import warnings

from megatron.core import parallel_state
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_mlp_module_spec_for_backend
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import TransformerLayer, get_transformer_layer_offset
from megatron.core.utils import get_pg_rank

from ..config import ENV_VARS, LAYERS, FlashOverlapConfig, active
from ..config.refusals import refuse
from .linear import FlashColumnParallelLinear, FlashRowParallelLinear
from .norm import SequenceParallelNorm, decoder_block_spec
from .sdpa import core_attention_for
from .probe import planned
from .attention import UlyssesDotProductAttention
from .query_split_pair import QuerySplitDotProductAttention, QuerySplitRowParallelLinear
from .moe.layer import check_moe_config, flash_moe_spec
from .step_kind import watch_step_kinds


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
               num_experts: int | None = None, moe_grouped_gemm: bool = False,
               transformer_impl: str = "local") -> ModuleSpec:
    """TransformerLayer spec = get_gpt_layer_local_spec(...) (its layer: FlashOverlapTransformerLayer, a
    TransformerLayer that records decode-only steps) with linear_qkv/proj/fc1/fc2 ours, and the norms
    and core attention of `_norms_and_attention` (attention_backend: Megatron's --attention-backend, an
    AttnBackend or its name; transformer_impl: Megatron's --transformer-impl; see sdpa.core_attention_for;
    by default get_gpt_layer_local_spec's DotProductAttention). num_experts: the MLP is Megatron's MoE spec
    (routed experts Megatron's, shared experts' fc1/fc2 ours) in our FlashMoELayer (megatron/moe/layer.py)."""
    provider = FlashOverlapSpecProvider(flash_config)
    spec = get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=moe_grouped_gemm,
                                    qk_layernorm=qk_layernorm, normalization=normalization, qk_l2_norm=qk_l2_norm)
    attention = submodules_of(spec.submodules.self_attention)
    attention.linear_qkv = provider.column_parallel_linear()
    attention.linear_proj = provider.row_parallel_linear()
    _norms_and_attention(spec.submodules, attention, provider.flash_config, qk_layernorm and not qk_l2_norm,
                         (attention_backend, transformer_impl))
    spec.submodules.mlp = mlp_spec(provider, num_experts, moe_grouped_gemm)
    spec.module = FlashOverlapTransformerLayer  # TransformerLayer + the decode-step record (megatron/step_kind.py)
    return spec


def mlp_spec(provider: FlashOverlapSpecProvider, num_experts: int | None = None, moe_grouped_gemm: bool = False):
    """Megatron's MLP spec for `provider` (our fc1/fc2); num_experts: its MoE spec in our FlashMoELayer."""
    mlp = get_mlp_module_spec_for_backend(backend=provider, num_experts=num_experts, moe_grouped_gemm=moe_grouped_gemm)
    return flash_moe_spec(mlp, provider.flash_config) if num_experts else mlp


def _norms_and_attention(layer, attention, flash_config: FlashOverlapConfig, qk_norm: bool, flags) -> None:
    """Norms: SequenceParallelNorm (TENorm with TE; builds under SP without apex, RMSNorm included) in the
    slots the local spec fills. Core attention: sdpa.core_attention_for(attention.core, *flags) (flags:
    --attention-backend, --transformer-impl): by default stock's. A config that is `reference`
    on every layer with attention.core auto is the stock layer, the serial baseline: stock's core attention."""
    layer.input_layernorm = layer.pre_mlp_layernorm = SequenceParallelNorm
    if qk_norm:
        attention.q_layernorm = attention.k_layernorm = SequenceParallelNorm
    core = flash_config.attention.core
    if core == "auto" and all(flash_config.plan(name).is_reference for name in LAYERS):
        core = "megatron"
    attention.core_attention = core_attention_for(core, *flags)


def select_attention(attn_submodules, flash_config, *, context_parallel_size: int,
                     sequence_parallel: bool | None) -> None:
    """Spec hook: choose core_attention / linear_proj of SelfAttentionSubmodules from `flash_config.attention`.

    - context_parallel_size > 1: UlyssesDotProductAttention (the local DotProductAttention refuses CP),
      its a2a algo = attention.ulysses_algo;
    - else, attention.query_split true: the query-split pair (needs SP: `sequence_parallel` must be True;
      None = unknown to the caller, a ValueError that says where to pass it);
    - else, attention.query_split auto (the default): the query-split pair where the core attention is
      Megatron's DotProductAttention, proj's algo is auto and SP is on (None, unknown: not built); the pair's
      core attention builds Megatron's DotProductAttention where query split cannot run in the model
      (query_split_cannot_run);
    - else: unchanged (the core attention chosen before, our FlashRowParallelLinear for proj)."""
    settings = flash_config.attention
    if context_parallel_size > 1:
        attn_submodules.core_attention = ModuleSpec(module=UlyssesDotProductAttention,
                                                    params={"flash_config": flash_config})
        return
    if settings.query_split == "auto":
        if (sequence_parallel is not True or attn_submodules.core_attention is not DotProductAttention
                or flash_config.plan("proj").algo != "auto"):
            return
    elif not settings.query_split:
        return
    elif sequence_parallel is None:
        raise ValueError("query-split attention needs sequence parallelism, which get_gpt_layer_flashoverlap_spec "
                         "cannot see (get_gpt_layer_local_spec's arguments do not carry it): pass "
                         "sequence_parallel=True, or turn attention.query_split off")
    elif not sequence_parallel:
        raise ValueError("query-split attention needs sequence parallelism (its reduce-scatter is what it hides); "
                         "set --sequence-parallel, or turn attention.query_split off (YAML attention: "
                         f"{{query_split: false}}, or {ENV_VARS['query_split']}=0)")
    attn_submodules.core_attention = ModuleSpec(module=QuerySplitDotProductAttention,
                                                params={"flash_config": flash_config})
    attn_submodules.linear_proj = ModuleSpec(module=QuerySplitRowParallelLinear,
                                             params={"flash_config": flash_config})


def _with_attention(spec: ModuleSpec, flash_config: FlashOverlapConfig, context_parallel_size,
                    sequence_parallel) -> ModuleSpec:
    """What every spec function returns: layer_spec's spec with the core attention the config asks for."""
    select_attention(submodules_of(spec.submodules.self_attention), flash_config,
                     context_parallel_size=context_parallel_size, sequence_parallel=sequence_parallel)
    return spec


def flashoverlap_layer_spec(config, vp_stage: int | None = None) -> TransformerBlockSubmodules:
    """The `--spec` entry point: Megatron calls it with its model config (and vp_stage). A block spec as stock's
    get_gpt_decoder_block_spec builds: per layer dense or MoE (--moe-layer-freq), this pipeline stage's layers
    (layout, first/last-stage counts, vp_stage), and our norm as the block's final norm."""
    return decoder_block_spec(model_layer_specs(config), config, vp_stage)


def model_layer_specs(config) -> list[ModuleSpec]:
    """One layer spec per decoder layer of the model (Megatron's model config): MoE where stock's reading of
    --moe-layer-freq says so (structure.moe_layer_pattern), dense elsewhere. The MoE spec is the dense one with
    the MLP swapped: the kinds share one attention spec and its norms, as stock's two local specs are equal there."""
    flash_config = planned(active())  # on CUDA: the planner fills what the YAML leaves open (megatron/probe.py)
    dense = _layer_for(config, flash_config)
    experts = getattr(config, "num_moe_experts", None)
    if not experts:
        return [dense] * config.num_layers
    moe_mlp = mlp_spec(FlashOverlapSpecProvider(flash_config), experts,
                       bool(getattr(config, "moe_grouped_gemm", False)))
    moe = ModuleSpec(module=dense.module, params=dense.params,
                     submodules=dataclasses.replace(dense.submodules, mlp=moe_mlp))
    return [moe if is_moe else dense for is_moe in moe_layer_pattern(config)]


def _layer_for(config, flash_config: FlashOverlapConfig | None = None) -> ModuleSpec:
    """The dense layer spec for Megatron's model config; settings the spec cannot build as stock does are refused
    first (config/refusals.py: the rows of the spec check, then check_moe_config's)."""
    refuse("spec", config, "flashoverlap_layer_spec")
    if getattr(config, "num_moe_experts", None):
        check_moe_config(config)  # flex / --overlap-moe-expert-parallel-comm: refused here, before the build
    flash_config = active() if flash_config is None else flash_config
    spec = layer_spec(flash_config, qk_layernorm=bool(getattr(config, "qk_layernorm", False)),
                      normalization=getattr(config, "normalization", None),
                      qk_l2_norm=bool(getattr(config, "qk_l2_norm", False)),
                      attention_backend=getattr(config, "attention_backend", None) or "auto",  # honoured
                      transformer_impl=getattr(config, "transformer_impl", "local"))  # stock: TE's spec or local
    return _with_attention(spec, flash_config, getattr(config, "context_parallel_size", 1) or 1,
                           bool(getattr(config, "sequence_parallel", False)))


def get_gpt_layer_flashoverlap_spec(num_experts=None, moe_grouped_gemm=False, qk_layernorm=False,
                                    multi_latent_attention=False, fp8=None, normalization=None, qk_l2_norm=False,
                                    use_kitchen=False, use_kitchen_attention=False, kitchen_attention_backend="sdpa",
                                    *, moe_use_legacy_grouped_gemm=False, flash_config=None,
                                    sequence_parallel=None, context_parallel_size=None, attention_backend="auto",
                                    transformer_impl="local") -> ModuleSpec:
    """Drop-in for megatron-core 0.19's `get_gpt_layer_local_spec` (same arguments, same order; 0.16's
    `moe_use_legacy_grouped_gemm` by keyword): the layer `flashoverlap_layer_spec` builds for the same
    settings. Keyword-only extras: flash_config (default: config.active()), sequence_parallel (needed only
    for query-split attention), context_parallel_size (default: Megatron's CP group size, else 1), and
    attention_backend / transformer_impl (the model config's: which core attention, as `layer_spec`; the stock
    function takes none and builds DotProductAttention, which the defaults give).
    MLA, Kitchen and the legacy grouped GEMM are a ValueError (config/refusals.py); fp8 is ignored, as in the
    stock function."""
    where = "get_gpt_layer_flashoverlap_spec"
    refuse("local_spec", None, where, multi_latent_attention=multi_latent_attention, use_kitchen=use_kitchen,
           use_kitchen_attention=use_kitchen_attention, moe_use_legacy_grouped_gemm=moe_use_legacy_grouped_gemm)
    if fp8 is not None:
        warnings.warn(f"{where}: fp8 is deprecated and ignored (as in get_gpt_layer_local_spec)", stacklevel=2)
    if context_parallel_size is None:
        initialized = parallel_state.model_parallel_is_initialized()
        context_parallel_size = parallel_state.get_context_parallel_world_size() if initialized else 1
    flash_config = planned(active()) if flash_config is None else flash_config  # on CUDA: megatron/probe.py
    spec = layer_spec(flash_config, qk_layernorm=bool(qk_layernorm), normalization=normalization,
                      qk_l2_norm=bool(qk_l2_norm), num_experts=num_experts, moe_grouped_gemm=bool(moe_grouped_gemm),
                      attention_backend=attention_backend, transformer_impl=transformer_impl)
    return _with_attention(spec, flash_config, context_parallel_size, sequence_parallel)


class FlashOverlapTransformerLayer(TransformerLayer):
    """A TransformerLayer whose submodules come from `model_layer_specs(config)` when it is built (config: the
    layer's TransformerConfig): the spec of the model's layer it is (dense or MoE, by its number in the model),
    so one module-level ModuleSpec, `flashoverlap_layer`, serves every Megatron path that takes a `--spec` object
    as it is (legacy gpt_builder, tools/checkpoint, --use-checkpoint-args) as well as 0.19's GPTModelBuilder.
    Given `submodules` (layer_spec's specs), it is that layer. Same modules, state_dict keys and forward as a
    TransformerLayer; each forward first tells its row-parallel linears whether it is a decode-only inference
    step (megatron/step_kind.py)."""

    def __init__(self, config, submodules=None, layer_number: int = 1, *args, **kwargs):
        if submodules is None:
            submodules = model_layer_specs(config)[_model_layer_id(config, layer_number, kwargs)].submodules
        super().__init__(config, submodules, layer_number, *args, **kwargs)
        watch_step_kinds(self)


def _model_layer_id(config, layer_number: int, kwargs: dict) -> int:
    """0-based id in the model of the layer a TransformerBlock builds as its `layer_number`-th (1-based, this
    stage): plus Megatron's offset, as TransformerLayer numbers itself. An MTP layer's inner layer is the
    model's last (stock's MTP spec copies the last decoder layer's spec)."""
    if kwargs.get("is_mtp_layer", False):
        return config.num_layers - 1
    if not kwargs.get("add_layer_offset", True):
        return layer_number - 1
    pg_collection = kwargs.get("pg_collection")
    pp_rank = None if pg_collection is None else get_pg_rank(pg_collection.pp)
    return layer_number - 1 + get_transformer_layer_offset(config, kwargs.get("vp_stage"), pp_rank)


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


def moe_layer_pattern(config) -> list[bool]:
    """[is layer i MoE] for i in 0..num_layers-1, as stock reads config.moe_layer_freq: an int N -> every N-th
    layer from the first (i % N == 0); a list (--moe-layer-freq '([0]+[1]*3)', parsed by Megatron) -> as given."""
    n = config.num_layers
    if not getattr(config, "num_moe_experts", None):
        return [False] * n
    freq = getattr(config, "moe_layer_freq", 1)
    if isinstance(freq, int) and not isinstance(freq, bool) and freq > 0:
        return [i % freq == 0 for i in range(n)]
    if isinstance(freq, (list, tuple)) and len(freq) == n and set(freq) <= {0, 1}:
        return [bool(x) for x in freq]
    raise ValueError(f"moe_layer_freq={freq!r}: give an int N > 0 (an MoE layer every N layers, from the first) or a "
                     f"list of num_layers={n} entries, 0 (dense) or 1 (MoE): --moe-layer-freq 2 or "
                     f"--moe-layer-freq '([0]+[1]*{n - 1})'")
