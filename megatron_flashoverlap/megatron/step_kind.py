"""The step kind of a forward, told to the row-parallel linears of a layer (Megatron's side only).

    step_kind(inference_context) -> "train" (no context: training, or a forward outside an engine)
                                    "decode" (`is_decode_only()`: StaticInferenceContext and DynamicInferenceContext)
                                    "mixed" (a dynamic step holding prefill and decode requests)
                                    "prefill" (every other inference step)
    watch_step_kinds(layer)         a forward pre-hook (with kwargs) on `layer` (a TransformerLayer): before each
                                    forward, every linear of ours inside it gets `flash_step_kind`;
                                    the first inference forward measures the context's token buckets first
                                    (measure_buckets, below)

The linear asks the chooser (plan/chooser.py) for an inference kind's plan: the decode all-reduce's algorithm
on a decode step, stock or decomposed on prefill and mixed steps. The words come from Python ints and bools
the context already holds (no device sync, so they are safe under CUDA graph capture).

The token buckets an inference context can meet, measured at its first step (the chooser's start-up probe).

    buckets(context) -> (prefill buckets, decode buckets), powers of two, smallest first
        dynamic (DynamicInferenceContext): every step's tokens are a multiple of round_up_tokens(1) (64 at TP <= 64)
            prefill / mixed  bucket(round_up_tokens(1)) .. bucket(max_tokens)
            decode           min(that multiple, cap) .. cap = min(max_tokens, max_requests) (the engine pads a
                             decode step to a multiple, at most cap)
        static (StaticInferenceContext): prefill 2 .. bucket(max_batch_size * max_sequence_length),
            decode 1 .. bucket(max_batch_size)
        anything else: ((), ()) (each bucket is measured on first use)
    measure_buckets(rows, context, x)   rows: the no-SP FlashRowParallelLinears of one TransformerLayer; x its
        input (dtype, device). Asks each row's `_inference_plan` at every bucket, smallest first, decode before
        prefill within a bucket; the chooser (plan/chooser.py) measures what no higher tier answers until
        choices.budget_s is spent and takes the model's (stock) for the rest, so no later step measures.
        Collective: every rank of the group runs it at the same layer's first inference forward.
Probes cost no memory: x is a zero-stride view of the bucket's shape; the chooser's measurements allocate theirs.
"""
from __future__ import annotations

import logging
import time

import torch
import torch.distributed as dist

from ..plan.chooser import bucket

log = logging.getLogger(__name__)


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
    from .linear import FlashColumnParallelLinear, FlashRowParallelLinear

    ours = [m for m in layer.modules() if isinstance(m, (FlashColumnParallelLinear, FlashRowParallelLinear))]
    rows = [m for m in ours if isinstance(m, FlashRowParallelLinear)]
    if not ours:
        return

    swept = []  # the first inference forward measures the context's buckets (measure_buckets), once

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


def _powers(first: int, last: int) -> tuple[int, ...]:
    out, b = [], bucket(first)
    while b <= bucket(last):
        out.append(b)
        b *= 2
    return tuple(out)


def buckets(context) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(prefill buckets, decode buckets) of `context` (module docstring)."""
    if all(hasattr(context, a) for a in ("round_up_tokens", "max_tokens", "max_requests")):
        first, cap = context.round_up_tokens(1), min(context.max_tokens, context.max_requests)
        return _powers(first, context.max_tokens), _powers(min(first, cap), cap)
    if hasattr(context, "max_batch_size") and hasattr(context, "max_sequence_length"):
        return _powers(2, context.max_batch_size * context.max_sequence_length), _powers(1, context.max_batch_size)
    return (), ()


def measure_buckets(rows, context, x: torch.Tensor) -> None:
    """Decide every bucket of `context` for `rows` (module docstring)."""
    prefill, decode = buckets(context)
    if not rows or not (prefill or decode):
        return
    chooser, start = rows[0].flash_chooser, time.perf_counter()
    spent, decided = chooser.spent_s, len(chooser.decided)
    kinds = [row.flash_step_kind for row in rows]
    try:
        for b in sorted(set(prefill) | set(decode)):
            for kind in ("decode",) * (b in decode) + ("prefill", "mixed") * (b in prefill):
                for row in rows:
                    row.flash_step_kind = kind
                    row._inference_plan(x.new_zeros(()).expand(b, 1, row.weight.shape[1]))
    finally:
        for row, kind in zip(rows, kinds):
            row.flash_step_kind = kind
    if len(chooser.decided) > decided and dist.get_rank(rows[0].tp_group) == 0:
        log.warning(f"flash-overlap decided {len(chooser.decided) - decided} choices at the first inference step "
                    f"in {time.perf_counter() - start:.1f} s ({chooser.spent_s - spent:.1f} s measured, "
                    f"choices.budget_s {chooser.budget_s:g}); choices.write keeps them for the next run")
