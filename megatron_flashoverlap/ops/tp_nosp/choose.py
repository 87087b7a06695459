"""The row-parallel output all-reduce of a prefill or mixed step: stock or decomposed, the chooser's measured tier.

    inference_plan(chooser, prefill_key(site, kind, x, weight, layout, members), x [s, b, k/P], weight_k [h, k/P],
                   group, ctx, plan) -> the OpPlan to run
        key: <site>/<kind>/<bucket of s * b>; where no higher tier answers (plan/chooser.py) and the budget
        allows, the two candidates run in paired rounds (runtime/timing.py `paired`) on x [bucket, 1, k/P] with
        the layer's own weight, forward only (inference):
            reference   y = AR(x @ w^T): one GEMM, then stock's all-reduce (registry.reference_plan: under FP8
                        the same FP8 GEMM)
            decomposed  `plan` (the layer's algo: chunked Flash-RS + Flash-AG, or slicing)
        ONCE per key; group rank 0 logs the one line. Inside a CUDA-graph capture nothing is measured.
A training step never asks: its plan is the layer's (forward and backward as one operator).
"""
from __future__ import annotations

import torch

from ...plan.chooser import Chooser, Key, Measured, bucket
from ...runtime.timing import paired
from ..choose import ROUNDS, WARMUP, settle
from ..registry import OpPlan, reference_plan
from ...runtime.fp8 import probe_state
from .autograd import ar_matmul_forward, matmul_all_reduce_fp8


def prefill_key(site: str, kind: str, x: torch.Tensor, weight: torch.Tensor, layout: str, members: tuple) -> Key:
    """The key of a row site's step: <site>/<kind>/<bucket of s * b> on `layout` (the group `members`), the
    weight's sizes (ops/choose.py group_layout gives layout and members)."""
    return Key(site, kind, bucket(x.shape[0] * x.shape[1]), layout, f"h {weight.shape[0]} k {weight.shape[1]}",
               members)


def inference_plan(chooser: Chooser, key: Key, x: torch.Tensor, weight: torch.Tensor, group, ctx,
                   plan: OpPlan) -> OpPlan:
    """`plan` where the chooser picks decomposed for `key` (prefill_key), the reference plan where it picks
    stock (module docstring)."""
    known = chooser.answer(key)
    if known is None:
        known = settle(chooser, key, x.device, group,
                       lambda: Measured.of(_samples(key.bucket, x, weight, group, ctx, plan)))
    return plan if known.pick == "decomposed" else reference_plan(plan)


def _samples(tokens: int, x, weight, group, ctx, plan) -> dict[str, list[float]]:
    """{reference, decomposed: [seconds per kept round]} of one forward on a probe x [tokens, 1, k/P]."""
    probe = torch.ones((tokens, 1, x.shape[-1]), dtype=x.dtype, device=x.device)
    with torch.no_grad():
        return paired({"reference": lambda: _forward(probe, weight, group, ctx, reference_plan(plan)),
                       "decomposed": lambda: _forward(probe, weight, group, ctx, plan)},
                      group, x.device, rounds=ROUNDS, warmup=WARMUP)


def _forward(probe, weight, group, ctx, plan):
    """The forward of `plan` on the probe: the plain function, or under FP8 the operator (it casts first; the
    delayed recipe with a throwaway state)."""
    if plan.fp8 is None:
        return ar_matmul_forward(probe, weight, group, ctx, plan)
    return matmul_all_reduce_fp8(probe, weight, group, plan=plan, scales=probe_state(plan.fp8), context=ctx)
