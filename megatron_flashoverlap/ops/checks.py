"""Preconditions of the overlap operators: checked before any transfer, each error names the fix.

The peer-agreement check (`peers_agree`) is one small all-gather plus a device-to-host read; under the
context's default check_peers="once" it runs once per (group, op, shape facts), so a steady state issues
only the operator's own traffic. What "once" gives up: a rank whose shapes were already agreed skips the
check, so if a later call disagrees the other ranks wait in the check until the transport's timeout
(gloo: PeerTimeoutError) or the process group's watchdog (NCCL). check_peers="always" checks every call.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..runtime import OverlapContext, default_context, group_info
from ..runtime.accumulate import check_wgrad_into

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
