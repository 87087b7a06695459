"""How stock reads --moe-layer-freq, for our spec to build the same layer kinds. Reads Megatron's model config
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
