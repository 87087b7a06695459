"""Preconditions of the overlap operators: checked before any transfer, each error names the fix.

The peer-agreement check (`peers_agree`) is one small all-gather plus a device-to-host read; under the
context's default check_peers="once" it runs once per (group, op, shape facts), so a steady state issues
only the operator's own traffic. What "once" gives up: a rank whose shapes were already agreed skips the
check, so if a later call disagrees the other ranks wait in the check until the transport's timeout
(gloo: PeerTimeoutError) or the process group's watchdog (NCCL). check_peers="always" checks every call.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..runtime import OverlapContext, default_context, group_info
from ..runtime.accumulate import check_wgrad_into
from ..runtime.fp8 import DelayedScales
from ..runtime.handlers import chunk_bounds
from .registry import plan_of, resolve

_FLOATS = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def check_operands(op: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
    """x [rows, b, in], weight [out, in], bias [out]: same dtype and device, floating point."""
    if x.dim() != 3:
        raise ValueError(f"{op}: input must be [s, b, h] (sequence first, Megatron layout); got shape "
                         f"{tuple(x.shape)}. Reshape to 3 dims, e.g. x.view(s, b, -1)")
    if weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
        raise ValueError(f"{op}: weight must be [out, {x.shape[-1]}] for an input with hidden size "
                         f"{x.shape[-1]}; got {tuple(weight.shape)}. Pass the weight as stored by "
                         f"Megatron's linear layers ([out, in]), not transposed")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is None:
            continue
        if t.dtype != x.dtype:
            raise ValueError(f"{op}: {name} dtype {t.dtype} differs from input dtype {x.dtype}; cast one "
                             f"of them (e.g. under torch.autocast, or weight.to(x.dtype))")
        if t.device != x.device:
            raise ValueError(f"{op}: {name} is on {t.device} but the input is on {x.device}; move both to "
                             f"the same device")
    if x.dtype not in _FLOATS:
        raise ValueError(f"{op}: dtype {x.dtype} is not supported; use float32, bfloat16 or float16")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"{op}: bias must be [{weight.shape[0]}]; got {tuple(bias.shape)}")


def check_divisible(op: str, rows: int, world: int) -> None:
    if rows % world:
        raise ValueError(f"{op}: sequence length {rows} is not divisible by the group size {world}; pad "
                         f"the sequence to a multiple of {world} (Megatron's sequence parallel needs the same)")


def check_peers_agree(op: str, group, world: int, device: torch.device, *facts: int) -> None:
    """All ranks of `group` must call `op` with the same shape facts; one small all-gather."""
    if world == 1:
        return
    mine = torch.tensor(facts, dtype=torch.int64, device=device)
    allf = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(allf, mine, group=group)
    rows = [tuple(t.tolist()) for t in allf]
    if any(r != rows[0] for r in rows):
        raise ValueError(f"{op}: ranks of the group disagree on the operand shapes {rows}; every rank of a "
                         f"tensor-parallel group must pass the same sequence length, batch and hidden size")


def peers_agree(op: str, group, world: int, device: torch.device, ctx: OverlapContext, *facts: int) -> None:
    """check_peers_agree under the context's policy: once per (group, op, facts), always, or never."""
    if world == 1 or ctx.check_peers == "never":
        return
    key = (op,) + facts
    if ctx.agreed(group, key):
        return
    check_peers_agree(op, group, world, device, *facts)
    ctx.remember_agreed(group, key)


def checked_context(op: str, x: torch.Tensor, weight: torch.Tensor, bias, group, context: OverlapContext | None,
                    route, divisible: bool = False) -> OverlapContext | None:
    """The checks every GEMM wrapper runs first (operands, where dW goes: `route`, a WgradRoute, divisibility,
    peers; the plan's knobs were checked when it was made). -> the context to run with, or None for a group of
    size 1 (the caller then runs the plain GEMM)."""
    check_operands(op, x, weight, bias)
    check_wgrad_into(op, weight, route.into, route.fn)
    ctx = context or default_context()
    rank, world = group_info(group)
    if world == 1:
        return None
    if divisible:
        check_divisible(op, x.shape[0], world)
    peers_agree(op, group, world, x.device, ctx, *x.shape, *weight.shape)
    return ctx


_FP8_OUT = (torch.float32, torch.bfloat16, torch.float16)  # what CUDA's _scaled_mm writes


def check_fp8_call(op: str, plan, scales, route) -> None:
    """The recipe's state matches it: DelayedScales of the same recipe under 'delayed', none under
    'tensorwise'; dW not handed to a caller's function (it takes bf16 operands)."""
    recipe = plan.fp8
    if recipe.recipe == "delayed" and (not isinstance(scales, DelayedScales) or scales.recipe != recipe):
        raise ValueError(f"{op}: the delayed recipe needs its state: pass scales=DelayedScales(plan.fp8), kept per "
                         f"layer and updated after each step (got {type(scales).__name__})")
    if recipe.recipe == "tensorwise" and scales is not None:
        raise ValueError(f"{op}: the tensorwise recipe keeps no state; pass scales=None")
    if route.fn is not None:
        raise ValueError(f"{op}: wgrad_fn takes the bf16 operands; with an FP8 recipe pass wgrad_into (or neither)")


def _tokens_per_wgrad_slice(rows: int, batch: int, world: int, plan) -> list[int]:
    """Tokens (K) of each wgrad GEMM of an FP8 backward, for the gathered operand's shard of `rows` rows (x's
    for the column, dy's for the row): a slice per arrived part of a shard on the flash ring (2 parts
    bidirectional, plan.hops one way), the whole gathered operand otherwise."""
    if plan.algo not in ("flash", "flash_bidir") or plan.keep_gathered:
        return [rows * world * batch]
    return [(b - a) * batch for a, b in chunk_bounds(rows, 2 if plan.bidirectional else plan.hops)]


_FP8_DIMS = {  # op -> the names of x's last dim and of the weight's rows (the K and N of its forward GEMM), and
    "all_gather_matmul": ("the hidden size", "the output features per rank", True),  # whether a ring cuts its wgrad
    "matmul_reduce_scatter": ("the input features per rank", "the hidden size", True),
    "matmul_all_reduce": ("the input features per rank", "the hidden size", False),
    "matmul_allreduce_dgrad": ("the hidden size", "the output features per rank", False),
}


def check_fp8_shapes(op: str, x: torch.Tensor, weight: torch.Tensor, rows: int, world: int, plan,
                     wgrad: bool) -> None:
    """CUDA's FP8 GEMM rules on the shapes this call will multiply (runtime/scaled_mm.py), before any transfer:
    x's last dim and the weight's rows (K and N of the forward, N and K of the dgrad) multiples of 16, and the
    tokens of every wgrad GEMM: for the sequence-parallel ops each slice of a gathered shard of `rows` rows (x's,
    or y's and dy's for the row op); for the all-reduce ops the whole sequence (the column's wgrad tail pieces
    are cut at multiples of 16 tokens)."""
    if x.dtype not in _FP8_OUT:
        raise ValueError(f"{op}: an FP8 GEMM writes {_FP8_OUT}; the input is {x.dtype}: cast it, or drop the FP8 "
                         f"recipe")
    (k_name, n_name, sliced), k, n = _FP8_DIMS[op], x.shape[-1], weight.shape[0]
    if k % 16 or n % 16:
        raise ValueError(f"{op}: FP8 needs {k_name} ({k}) and {n_name} ({n}) to be multiples of 16 (CUDA's "
                         f"_scaled_mm); pad them, or drop the FP8 recipe")
    batch = math.prod(x.shape[1:-1])
    bad = [t for t in (_tokens_per_wgrad_slice(rows, batch, world, plan) if sliced else [x.shape[0] * batch])
           if t % 16]
    if wgrad and bad:
        fix = ("(sequence / group size / slices per shard) * batch a multiple of 16 (fewer hop_chunks, or a longer "
               "sequence)" if sliced else "sequence * batch a multiple of 16 (pad the sequence)")
        raise ValueError(f"{op}: the FP8 weight gradient multiplies over tokens, {bad} per GEMM slice here, which "
                         f"CUDA needs in multiples of 16; make {fix}, or drop the FP8 recipe")


def fp8_plan(op: str, plan, call, default_chunks: int | None = None):
    """The resolved plan of an FP8 call (registry.resolve), its recipe and state checked (check_fp8_call)."""
    plan = resolve(op, plan_of(op, None, plan), default_chunks)
    if plan.fp8 is None:
        raise ValueError(f"{op}_fp8: plan.fp8 is None; pass OpPlan(..., fp8=Fp8Recipe(...)), or call {op} for the "
                         f"bf16 GEMMs")
    check_fp8_call(op, plan, call.scales, call.route)
    return plan

