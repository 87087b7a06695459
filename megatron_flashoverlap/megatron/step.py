"""The step kind of an inference forward, told to the row-parallel linears of a layer (Megatron's side only).

    watch_decode_steps(layer)   a forward pre-hook (with kwargs) on `layer` (a TransformerLayer): before each
                                forward, every FlashRowParallelLinear inside it gets `flash_decode_step` =
                                whether that forward's `inference_context` says decode-only
                                (`is_decode_only()`: StaticInferenceContext and DynamicInferenceContext alike;
                                no context, e.g. training: False)

The linear hands it to its operator inside its plan (`OpPlan.decode_step`, megatron/linear.py): a decode-only
step runs the decode all-reduce whatever its layout (the static engine's [1, b, h], the dynamic engine's
flattened [n, 1, h]); prefill and mixed prefill + decode steps keep the decomposed all-reduce. The word is a
Python bool the context already holds (no device sync, so it is safe under CUDA graph capture).
"""
from __future__ import annotations

import torch


def is_decode_step(inference_context) -> bool:
    """Whether a forward with this `inference_context` (None: not inference) is a decode-only step."""
    return inference_context is not None and bool(inference_context.is_decode_only())


def watch_decode_steps(layer: torch.nn.Module) -> None:
    """Record each forward's step kind on the FlashRowParallelLinears inside `layer` (module docstring)."""
    from .linear import FlashRowParallelLinear

    rows = [m for m in layer.modules() if isinstance(m, FlashRowParallelLinear)]
    if not rows:
        return

    def record(_module, _args, kwargs):
        decode = is_decode_step(kwargs.get("inference_context"))
        for row in rows:
            row.flash_decode_step = decode

    layer.register_forward_pre_hook(record, with_kwargs=True)
