"""A training step's site under `algo: auto`: stock or flash, the chooser's measured tier (plan/chooser.py).

    train_plan(layer, train_key(site, x, weight, layout, members), op, x, flash)
        -> `flash` (the layer's flash OpPlan) or None (stock: the layer runs Megatron's own forward; under FP8
           the layer's FP8 reference instead, megatron/linear.py)
        op: the layer's operator, op(x, weight, group, plan=, context=) -> y, with autograd
            all_gather_matmul (column, SP), matmul_reduce_scatter (row, SP),
            matmul_allreduce_dgrad (column, no SP), matmul_all_reduce (row, no SP)
        key: <site>/train/<bucket of the input's s * b>; where no higher tier answers and the budget allows, the
        candidates run forward + backward in paired rounds (runtime/timing.py `paired`) on a probe of x's shape
        with a detached copy of the weight (dW returned and dropped: main_grad and the DP buffers untouched):
            reference   reference_plan(flash): the blocking collective, then the GEMM (stock's order; under FP8
                        the same FP8 GEMM as flash's: Megatron's forward has none)
            flash       the layer's flash plan (decomposed ring, rank-adaptive slices)
        ONCE per key; the samples are the max over `replicas(group)` as well (the ranks that must run the same
        arithmetic: Megatron's tensor + data parallel group of this pipeline stage), so every replica of a
        site takes the same choice.
"""
from __future__ import annotations

from typing import Callable

import torch

from ..plan.chooser import Chooser, Key, bucket
from ..runtime.timing import paired
from ..ops.choose import ROUNDS, WARMUP, settle
from ..ops.registry import OpPlan, reference_plan
from ..runtime.fp8 import probe_state
from .fp8 import run as call_op


def train_key(site: str, x: torch.Tensor, weight: torch.Tensor, layout: str, members: tuple) -> Key:
    """<site>/train/<bucket of s * b> on `layout`, the weight's sizes (ops/choose.py group_layout: layout,
    members)."""
    return Key(site, "train", bucket(x.shape[0] * x.shape[1]), layout,
               f"w {weight.shape[0]}x{weight.shape[1]} x {x.shape[-1]}", members)


def train_plan(layer, key: Key, op: Callable, x: torch.Tensor, flash: OpPlan) -> OpPlan | None:
    """`flash` where the chooser picks it for `key`, None (stock) where it keeps stock (module docstring);
    `layer`: the linear (its weight, tp_group, flash_context, flash_chooser)."""
    chooser: Chooser = layer.flash_chooser
    known = chooser.answer(key)
    if known is None:
        known = settle(chooser, key, x.device, layer.tp_group,
                       lambda: _samples(op, x, layer.weight, layer.tp_group, layer.flash_context, flash))
    return flash if known.pick == "flash" else None


def replicas(tp_group):
    """Megatron's tensor + data (+ context) parallel group of this pipeline stage: the ranks whose auto choices
    must agree; None where Megatron's parallel state is not up or `tp_group` is not its TP group (the TP group
    alone decides)."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized() or tp_group is not ps.get_tensor_model_parallel_group():
        return None
    return ps.get_tensor_and_data_parallel_group(with_context_parallel=True)


def _samples(op, x, weight, group, ctx, flash) -> dict[str, list[float]]:
    """{reference, flash: [seconds per kept round]} of one forward + backward on a probe of x's shape (under the
    delayed FP8 recipe with a state of its own: the layer's amax history never sees the probe)."""
    probe = torch.ones_like(x).requires_grad_()
    w = weight.detach().requires_grad_()
    scales = probe_state(flash.fp8)

    def step(plan):
        def run():
            y = call_op(op, probe, w, group, plan, scales, context=ctx)
            y.backward(torch.ones_like(y))
            probe.grad = w.grad = None
        return run
    with torch.enable_grad():
        return paired({"reference": step(reference_plan(flash)), "flash": step(flash)}, group, x.device, rounds=ROUNDS,
                      warmup=WARMUP, replicas=replicas(group))
