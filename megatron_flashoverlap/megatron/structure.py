"""Which of Megatron's model-structure settings our block spec builds as stock does, and which it refuses.
Reads Megatron's model config (a TransformerConfig, 0.19's GPTModelConfig proxying one, or parsed args) by
attribute name only: no Megatron import, so args.py uses it at parse time.

    moe_layer_pattern(config) -> [bool] * num_layers    True where the layer is MoE: stock's reading of
                                                         --moe-layer-freq (get_gpt_decoder_layer_specs); all
                                                         False without experts (stock builds dense layers)
    check_structure(config, where)                       ValueError naming the fix for a setting the spec
                                                         cannot build as stock does (REFUSED, LOW_PRECISION)
    refuse_low_precision(get, where, fields)             the FP8/FP4 refusal: `get(field)` reads args or config

Honoured as stock (built by Megatron's own code or sliced with Megatron's own functions): --moe-layer-freq
(per-layer dense / MoE), --num-layers-in-first/last-pipeline-stage, --pipeline-model-parallel-layout,
account_for_embedding/loss_in_pipeline_split and vp_stage (norm.stage_layer_ids), --mtp-num-layers (Megatron's
GPT builders build MTP layers from their own local spec whatever --spec says: stock linears, named so in the
GEMM sites line), --no-rope-freq / --window-attn-skip-freq (read by the layers themselves).
"""
from __future__ import annotations

from typing import Callable

FLAG = "--flash-overlap"
_DROP = "drop --flash-overlap to let Megatron build it"


def _te(config) -> bool:
    return getattr(config, "transformer_impl", None) == "transformer_engine"


# (config field, refused when, what stock builds there, the fix). Each row names the flag a user typed.
REFUSED: tuple[tuple[str, Callable, str, str], ...] = (
    ("multi_latent_attention", lambda v, c: bool(v),
     "multi-latent attention (--multi-latent-attention) builds MLASelfAttention, whose linears are not ours yet",
     f"drop --multi-latent-attention, or {_DROP}"),
    ("experimental_attention_variant", lambda v, c: v is not None,
     "--experimental-attention-variant {v} builds its own block spec (gated delta net / DSA layers, "
     "--linear-attention-freq)", f"drop --experimental-attention-variant, or {_DROP}"),
    ("heterogeneous_block_specs", lambda v, c: bool(v),
     "heterogeneous layer configs (--heterogeneous-layers-config-path / --heterogeneous-layers-config-encoded-json) "
     "give every layer its own config and spec", f"drop the heterogeneous layers config, or {_DROP}"),
    ("use_kitchen", lambda v, c: bool(v),
     "Kitchen (--use-kitchen) replaces the linears and attention with its quantized ones",
     f"drop --use-kitchen, or {_DROP}"),
    ("transformer_impl", lambda v, c: v == "inference_optimized",
     "--transformer-impl inference_optimized builds Megatron's inference layers",
     "use --transformer-impl local or transformer_engine"),
    ("use_te_activation_func", lambda v, c: bool(v) and _te(c),
     "use_te_activation_func (--use-te-activation-func) puts Transformer Engine's activation module in the MLP",
     "drop --use-te-activation-func (our MLP runs Megatron's activation)"),
    ("use_grouped_gemm_for_dense_mlp", lambda v, c: bool(v) and _te(c),
     "use_grouped_gemm_for_dense_mlp builds Transformer Engine's fused dense MLP", "leave it False"),
    ("use_transformer_engine_op_fuser", lambda v, c: bool(v) and _te(c),
     "use_transformer_engine_op_fuser builds Transformer Engine's fused MLP", "leave it False"),
)

# Settings that turn on Transformer Engine's FP8 / FP4 GEMMs (the MoE experts' FP8 path included): (field,
# flag). Our linears run their GEMMs in the parameters' dtype, so the run would train without FP8, silently.
LOW_PRECISION_ARGS = (("fp8", "--fp8-format"), ("fp4", "--fp4-format"), ("fp8_param_gather", "--fp8-param-gather"),
                      ("fp4_param_gather", "--fp4-param-gather"))
LOW_PRECISION_CONFIG = (("fp8", "--fp8-format"), ("fp4", "--fp4-format"), ("fp8_param", "--fp8-param-gather"),
                        ("fp4_param", "--fp4-param-gather"),
                        ("fp8_dot_product_attention", "fp8_dot_product_attention"),
                        ("fp8_multi_head_attention", "fp8_multi_head_attention"))


def refuse_low_precision(get: Callable[[str], object], where: str, fields=LOW_PRECISION_CONFIG) -> None:
    """ValueError for the first FP8/FP4 setting `get(field)` reports on (None / False: off)."""
    for field, flag in fields:
        value = get(field)
        if value not in (None, False):
            shown = flag if value is True else f"{flag} {value}"
            raise ValueError(f"{where}: {shown} turns on Transformer Engine's FP8/FP4 GEMMs, which the "
                             f"{FLAG} linears do not run (they would train in the parameters' dtype, without "
                             f"FP8/FP4, silently); drop {flag}, or drop {FLAG} to use Transformer Engine's FP8/FP4")


def check_structure(config, where: str) -> None:
    """ValueError (what stock builds there, the fix) for the first REFUSED or FP8/FP4 setting in `config`."""
    for field, refused, what, fix in REFUSED:
        value = getattr(config, field, None)
        if refused(value, config):
            raise ValueError(f"{where}: {what.format(v=value)}, which the {FLAG} spec does not build; {fix}")
    refuse_low_precision(lambda field: getattr(config, field, None), where)


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
