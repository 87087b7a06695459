"""The fused expert pipeline inside Megatron's MoELayer (moe.algo = flash): what may fuse, and the call.

    fusion_blocker(layer) -> None, or the reason flash runs "exchange" instead
    pipeline_inputs(layer, tokens) -> (LocalExperts, counts [P][E], input_splits [P]): what expert_pipeline takes
    fused_experts(layer, tokens [sum(input_splits), h], probs [sum(input_splits)]) -> [sum(input_splits), h]
        ops/moe expert_pipeline with the layer's SequentialMLP on each source block: rows from source s are
        grouped by local expert with counts[s] = num_global_tokens_per_local_expert[s] (stock's sort is not
        needed: a block is already in local-expert order), probs applied by the experts where stock applies
        them (per_token_scale after the activation, or on the input with moe_apply_probs_on_input).
Routing, permutation and unpermutation stay the dispatcher's (stock's order of every sum that decides a route).
"""
from __future__ import annotations

import torch
from megatron.core.transformer.moe.experts import SequentialMLP

from ...ops.moe import LocalExperts, expert_pipeline


def fusion_blocker(layer) -> str | None:
    """Why this MoE layer cannot run the fused pipeline (None: it can), with what to change."""
    d, cfg = layer.token_dispatcher, layer.config
    checks = (
        (d.ep_size == 1, "expert_model_parallel_size = 1: no exchange to hide"),
        (d.tp_size > 1, "expert_tensor_parallel_size > 1: the experts' own TP collectives would run inside each "
                        "block; set --expert-tensor-parallel-size 1 to fuse"),
        (not isinstance(layer.experts, SequentialMLP), f"{type(layer.experts).__name__} experts (grouped GEMM) "
                                                       f"run all rows in one kernel; --moe-grouped-gemm off fuses"),
        (bool(getattr(layer, "shared_expert_overlap", False)), "moe_shared_expert_overlap runs the shared expert "
                                                               "inside the dispatcher on a side stream"),
        (bool(cfg.fp8 or getattr(cfg, "fp4", None)), "fp8/fp4 experts pad and scale per call"),
        (bool(getattr(cfg, "overlap_dispatch_backward_with_experts_wgrad", False)),
         "overlap_dispatch_backward_with_experts_wgrad delays the experts' wgrad"),
        (getattr(cfg, "transformer_impl", "") == "inference_optimized", "inference-optimized experts"),
    )
    return next((why for blocked, why in checks if blocked), None)


def _source_counts(d) -> torch.Tensor:
    """[ep, local experts]: rows from each source rank per local expert (host ints; one copy if on device)."""
    if d.num_local_experts > 1 or d.drop_and_pad:
        return d.num_global_tokens_per_local_expert.reshape(d.ep_size, d.num_local_experts).cpu()
    return torch.as_tensor(d.output_splits).reshape(d.ep_size, 1)


def pipeline_inputs(layer, tokens: torch.Tensor) -> tuple[LocalExperts, torch.Tensor, list]:
    """(the layer's experts as LocalExperts, counts [P][E], input_splits [P]) for ops/moe's expert_pipeline."""
    d = layer.token_dispatcher
    ins = d.input_splits if d.input_splits is not None else [tokens.shape[0] // d.ep_size] * d.ep_size

    def experts(x, rows_per_expert, p):
        out, bias = layer.experts(x, torch.tensor(rows_per_expert, dtype=torch.long), p)
        assert bias is None, "SequentialMLP adds the expert bias itself when probs are passed"
        return out

    params = [p for p in layer.experts.parameters() if p.requires_grad]
    return LocalExperts(experts, params), _source_counts(d), ins


def fused_experts(layer, tokens: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """The fused dispatch -> experts -> combine of one MoE layer call (module docstring)."""
    d = layer.token_dispatcher
    for point in ("before_permutation_2", "before_finish"):  # stock's host syncs of the split sizes
        d.tokens_per_expert = d._maybe_dtoh_and_synchronize(point, d.tokens_per_expert)
    d.tokens_per_expert = None
    experts, counts, ins = pipeline_inputs(layer, tokens)
    return expert_pipeline(tokens, probs, experts, counts, ins, d.ep_group, d.flash_ctx, algo="flash")
