"""The step kind of a forward, told to the row-parallel linears of a layer (Megatron's side only).

    step_kind(inference_context) -> "train" (no context: training, or a forward outside an engine)
                                    "decode" (`is_decode_only()`: StaticInferenceContext and DynamicInferenceContext)
                                    "mixed" (a dynamic step holding prefill and decode requests)
                                    "prefill" (every other inference step)
    watch_step_kinds(layer)         a forward pre-hook (with kwargs) on `layer` (a TransformerLayer): before each
                                    forward, every linear of ours inside it gets `flash_step_kind`;
                                    the first inference forward measures the context's token buckets first
                                    (megatron/buckets.py)

The linear asks the chooser (plan/chooser.py) for an inference kind's plan: the decode all-reduce's algorithm
on a decode step, stock or decomposed on prefill and mixed steps. The words come from Python ints and bools
the context already holds (no device sync, so they are safe under CUDA graph capture).
"""
from __future__ import annotations

import torch


def step_kind(inference_context) -> str:
    """The kind of a forward with this `inference_context` (module docstring)."""
    if inference_context is None:
        return "train"
    if inference_context.is_decode_only():
        return "decode"
    active = getattr(inference_context, "total_request_count", 0) - getattr(inference_context, "paused_request_count", 0)
    prefill = getattr(inference_context, "num_prefill_requests", active)
    return "mixed" if active - prefill > 0 else "prefill"


def watch_step_kinds(layer: torch.nn.Module) -> None:
    """Record each forward's step kind on our linears inside `layer` (module docstring)."""
    from .buckets import measure_buckets
    from .linear import FlashColumnParallelLinear, FlashRowParallelLinear

    ours = [m for m in layer.modules() if isinstance(m, (FlashColumnParallelLinear, FlashRowParallelLinear))]
    rows = [m for m in ours if isinstance(m, FlashRowParallelLinear)]
    if not ours:
        return

    swept = []  # the first inference forward measures the context's buckets (megatron/buckets.py), once

    def record(_module, args, kwargs):
        context = kwargs.get("inference_context")
        kind = step_kind(context)
        for linear in ours:
            linear.flash_step_kind = kind
        if kind != "train" and not swept:
            swept.append(kind)
            hidden = args[0] if args else kwargs.get("hidden_states")
            measure_buckets([r for r in rows if r._stock_reason() is None and not r.sequence_parallel],
                            context, hidden)

    layer.register_forward_pre_hook(record, with_kwargs=True)
