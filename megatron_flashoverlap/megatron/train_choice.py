"""A training step's site under `algo: auto`: stock, flash or flash_c2, the chooser's measured tier (plan/chooser.py).

    train_plan(layer, train_key(site, op, x, weight, layout, members), op, x, flash)
        -> `flash` (the layer's flash OpPlan), `flash` with hop_chunks 2 (flash_c2), or None (stock: the layer
           runs Megatron's own forward; under FP8 the layer's FP8 reference instead, megatron/linear.py)
        op: the layer's operator, op(x, weight, group, plan=, context=) -> y, with autograd
            all_gather_matmul (column, SP), matmul_reduce_scatter (row, SP),
            matmul_allreduce_dgrad (column, no SP), matmul_all_reduce (row, no SP)
        key: <site>/train/<bucket of the input's s * b>, of this operator (a choice measured under sequence
        parallelism never answers the same site without it: its candidates differ); where no higher tier
        answers and the budget allows, the
        candidates run forward + backward in paired rounds (runtime/timing.py `paired`) on a probe of x's shape
        with a detached copy of the weight (dW returned and dropped: main_grad and the DP buffers untouched):
            reference   reference_plan(flash): the blocking collective, then the GEMM (stock's order; under FP8
                        the same FP8 GEMM as flash's: Megatron's forward has none)
            flash       the layer's flash plan (decomposed ring, rank-adaptive slices)
            flash_c2    the same with every hop in 2 row sub-chunks (hop_chunks 2): the remote block's GEMM
                        starts on the first half to arrive, where a hop is long against its slice. A candidate
                        only for the sequence-parallel ops, where the YAML leaves hop_chunks open, the shard has
                        2 rows or more and no FP8 recipe runs (its wgrad slices would need 16-token multiples)
        ONCE per key; the samples are the max over `replicas(group)` as well (the ranks that must run the same
        arithmetic: Megatron's tensor + data parallel group of this pipeline stage), so every replica of a
        site takes the same choice.

    query_split_plan(layer, query_split_key(q, k, weight, layout, members), pending, flash, query_split)
        -> (pick, plan): proj's pair under attention.query_split (true, or auto where it can run), where proj's
           algo is auto; pending: the core attention's PendingAttention (q, k, v, stock's attention, the mask draw):
            reference   stock's attention, then Megatron's forward (timed as stock's attention, then the blocking
                        reduce-scatter after the GEMM: reference_plan(flash))
            flash       stock's attention, then `flash` (matmul_reduce_scatter's ring)
            flash_c2    the same with hop_chunks 2, where train_plan's rule allows it
            query_split `query_split`: each query block's attention + GEMM while the previous block flies
        Each candidate's time includes the attention, dropout included. For the first three, each round times
        Megatron's attention (its dropout inside) once and adds it to their GEMM + RS, timed on a probe of its
        output: stock's order runs one after the other. query_split is timed whole, the same draw
        (ops/attention/core.py draw_keep) applied per block inside its timed run. The probe runs inside
        torch.random.fork_rng: what the RNG gives next is what it gave before the probe, so the step's own
        dropout draws stock's masks. Measured as train_plan measures: forward + backward on probes of q, k, v's
        shapes and a detached copy of the weight.
"""
from __future__ import annotations

from typing import Callable

import dataclasses
import functools

import torch

from ..ops import all_gather_matmul, matmul_reduce_scatter
from ..ops.attention.query_split import query_split_attention
from ..plan.chooser import Chooser, Key, Measured, bucket
from ..runtime.timing import paired
from ..ops.choose import ROUNDS, WARMUP, settle
from ..ops.registry import OpPlan, reference_plan
from ..runtime import group_info
from ..runtime.fp8 import probe_state
from .fp8 import run as call_op


def train_key(site: str, op: Callable, x: torch.Tensor, weight: torch.Tensor, layout: str, members: tuple) -> Key:
    """<site>/train/<bucket of s * b> of `op` on `layout`, the weight's sizes (ops/choose.py group_layout: layout,
    members)."""
    return Key(site, "train", bucket(x.shape[0] * x.shape[1]), layout,
               f"{op.__name__} w {weight.shape[0]}x{weight.shape[1]} x {x.shape[-1]}", members)


def train_plan(layer, key: Key, op: Callable, x: torch.Tensor, flash: OpPlan) -> OpPlan | None:
    """`flash` where the chooser picks it for `key`, None (stock) where it keeps stock (module docstring);
    `layer`: the linear (its weight, tp_group, flash_context, flash_chooser)."""
    plans = candidates(op, x, flash, group_info(layer.tp_group)[1])
    pick = _pick(layer, key, x.device, plans, "this layer", ": hop sub-chunks run only under sequence "
                 "parallelism, without FP8, with hop_chunks open in the YAML",
                 lambda: _samples(op, x, layer.weight, layer.tp_group, layer.flash_context, plans))
    return None if pick == "reference" else plans[pick]


def _pick(layer, key: Key, device, plans: dict, of: str, why: str, measure) -> str:
    """The chooser's pick for `key`: a higher tier's answer, else settled by `measure`; "reference" or one of
    `plans` (a pinned pick outside them: a ValueError naming the candidates of `of`, with `why`)."""
    chooser: Chooser = layer.flash_chooser
    known = chooser.answer(key)
    if known is None:
        known = settle(chooser, key, device, layer.tp_group, measure)
    if known.pick != "reference" and known.pick not in plans:
        raise ValueError(f"choices.pinned: {key.word}: {known.pick} is not a candidate of {of} "
                         f"({', '.join(plans)}{why}); pin one of those, or remove the entry")
    return known.pick


def candidates(op: Callable, x: torch.Tensor, flash: OpPlan, world: int) -> dict[str, OpPlan]:
    """{pick: plan} of the layer's candidates other than stock (module docstring); x: the op's input, a shard of
    the sequence for all_gather_matmul, the whole sequence for matmul_reduce_scatter."""
    plans = {"flash": flash}
    shard = {all_gather_matmul: x.shape[0], matmul_reduce_scatter: x.shape[0] // world}.get(op, 0)
    if shard >= 2 and flash.algo == "flash" and flash.hop_chunks is None and flash.fp8 is None:
        plans["flash_c2"] = dataclasses.replace(flash, hop_chunks=2)
    return plans


def replicas(tp_group):
    """Megatron's tensor + data (+ context) parallel group of this pipeline stage: the ranks whose auto choices
    must agree; None where Megatron's parallel state is not up or `tp_group` is not its TP group (the TP group
    alone decides)."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized() or tp_group is not ps.get_tensor_model_parallel_group():
        return None
    return ps.get_tensor_and_data_parallel_group(with_context_parallel=True)


def _samples(op, x, weight, group, ctx, plans) -> Measured:
    """{reference, each of `plans`: [seconds per kept round]} and their sum: one forward + backward on a probe of
    x's shape (under the delayed FP8 recipe with a state of its own: the layer's amax history never sees the
    probe)."""
    probe = torch.ones_like(x).requires_grad_()
    w = weight.detach().requires_grad_()
    flash = plans["flash"]
    scales = probe_state(flash.fp8)
    every = {"reference": reference_plan(flash), **plans}
    runs = {pick: functools.partial(call_op, op, probe, w, group, plan, scales, context=ctx)
            for pick, plan in every.items()}
    return Measured.of(_paired_fwd_bwd(runs, (probe, w), group, x.device))


def _paired_fwd_bwd(forwards: dict, leaves: tuple, group, device) -> dict[str, list[float]]:
    """{pick: [seconds per kept round]}: forwards[pick]() then its backward of ones, in paired rounds on `group`
    (the max over `replicas(group)` too); the leaves' grads dropped after each run."""
    def run_of(forward):
        def run():
            y = forward()
            y.backward(torch.ones_like(y))
            for t in leaves:
                t.grad = None
        return run
    with torch.enable_grad():
        return paired({pick: run_of(f) for pick, f in forwards.items()}, group, device, rounds=ROUNDS,
                      warmup=WARMUP, replicas=replicas(group))


def query_split_key(q: torch.Tensor, k: torch.Tensor, weight: torch.Tensor, layout: str, members: tuple) -> Key:
    """proj/train/<bucket of s * b> of the query-split pair on `layout` (a key of its own: never the answer for a
    proj that runs matmul_reduce_scatter alone)."""
    return Key("proj", "train", bucket(q.shape[0] * q.shape[1]), layout,
               f"query_split_attention w {weight.shape[0]}x{weight.shape[1]} q {q.shape[2]}x{q.shape[3]} "
               f"kv {k.shape[2]}", members)


def query_split_plan(layer, key: Key, pending, flash: OpPlan, query_split: OpPlan) -> tuple[str, OpPlan | None]:
    """(pick, plan) of the query-split pair at `key` (module docstring); `layer`: QuerySplitRowParallelLinear."""
    q = pending.qkv[0]
    plans = {**candidates(matmul_reduce_scatter, q, flash, group_info(layer.tp_group)[1]),
             "query_split": query_split}
    pick = _pick(layer, key, q.device, plans, "the query-split pair", ", or reference",
                 lambda: _query_split_samples(pending, layer.weight, layer.tp_group, layer.flash_context, plans))
    return pick, plans.get(pick)


def _query_split_samples(pending, weight, group, ctx, plans) -> Measured:
    """{reference, each of `plans`: [seconds per kept round]}, the seconds measured: forward + backward on
    probes of q, k, v, the RNG restored after (module docstring). Stock's order runs the attention, then the
    GEMM + RS: each round times Megatron's attention once and each GEMM + RS on a probe of its output, and a
    candidate's sample is the two added (so the samples count the attention three times, the seconds once);
    query_split is timed whole."""
    q = pending.qkv[0]
    probes = tuple(torch.ones_like(t).requires_grad_() for t in pending.qkv)
    out = torch.ones(q.shape[0], q.shape[1], q.shape[2] * q.shape[3], dtype=q.dtype, device=q.device,
                     requires_grad=True)  # the attention's output [s, b, np/tp*hn]
    w = weight.detach().requires_grad_()
    devices = [q.device.index if q.device.index is not None else torch.cuda.current_device()] \
        if q.device.type == "cuda" else []

    def query_split():  # the draw inside the timed run, as stock's dropout is inside stock's attention
        attend = pending.attend_with(pending.draw(*probes[:2]))
        return query_split_attention(*probes, w, group, attend=attend, plan=plans["query_split"], context=ctx)

    gemm_rs = {"reference": reference_plan(plans["flash"]),
               **{pick: plan for pick, plan in plans.items() if pick != "query_split"}}
    with torch.random.fork_rng(devices=devices):
        forwards = {"attention": lambda: pending.stock(*probes),
                    **{pick: functools.partial(call_op, matmul_reduce_scatter, out, w, group, plan, None,
                                               context=ctx) for pick, plan in gemm_rs.items()},
                    "query_split": query_split}
        samples = _paired_fwd_bwd(forwards, (*probes, out, w), group, q.device)
    spent = sum(sum(ts) for ts in samples.values())  # the attention once a round, as it ran
    attention = samples.pop("attention")
    return Measured({pick: ([a + t for a, t in zip(attention, ts)] if pick in gemm_rs else ts)
                     for pick, ts in samples.items()}, spent)
