"""Ulysses all-to-all: sequence shards <-> head shards, on the runtime's pairwise pipeline or stock.

    seq -> heads (before attention):  x_s [s/P, b, H, d]  ->  x_h [s, b, H/P, d]
    heads -> seq (after attention):   y_h [s, b, H/P, d]  ->  y_s [s/P, b, H, d]

"flash": runtime.produce_all_to_all / consume_all_to_all (pairwise steps on the one executor, own piece
last / first; several tensors in one merged walk, one tag per tensor). "reference": one blocking
all_to_all_single per tensor. Registered as "ulysses.seq_to_heads" / "ulysses.heads_to_seq" in
ops/registry.py: (tensors, group, ctx) -> tensors. SeqToHeads / HeadsToSeq are the autograd.Functions;
each one's backward is the other's forward (the dual).
Head group g = heads [g*H/P, (g+1)*H/P); the row block of rank src = rows [src*s/P, (src+1)*s/P).
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from ...runtime import consume_all_to_all, group_info, names_operator, produce_all_to_all
from ..registry import plain, register

S2H, H2S = "ulysses.seq_to_heads", "ulysses.heads_to_seq"


def group_heads(t: torch.Tensor, g: int, world: int) -> torch.Tensor:
    """Head group g of t [.., H, d] along dim 2: [.., H/P, d]."""
    n = t.shape[2] // world
    return t[:, :, g * n:(g + 1) * n]


@register(S2H, "flash")
def seq_to_heads_flash(xs: Sequence[torch.Tensor], group, ctx) -> list[torch.Tensor]:
    """[s/P, b, H_i, d] each -> [s, b, H_i/P, d] each, in one walk (one tag per tensor)."""
    world = group_info(group)[1]
    makes = [lambda g, x=x: group_heads(x, g, world) for x in xs]
    return produce_all_to_all(makes, [tuple(x.shape) for x in xs], xs[0].dtype, xs[0].device, group, ctx)


@register(H2S, "flash")
def heads_to_seq_flash(ys: Sequence[torch.Tensor], group, ctx) -> list[torch.Tensor]:
    """[s, b, H_i/P, d] each -> [s/P, b, H_i, d] each, in one walk: piece src lands in head group src."""
    world = group_info(group)[1]
    outs = [torch.empty((y.shape[0] // world, y.shape[1], y.shape[2] * world) + tuple(y.shape[3:]),
                        dtype=y.dtype, device=y.device) for y in ys]

    def into(out):
        return lambda src, piece: group_heads(out, src, world).copy_(piece)

    consume_all_to_all(ys, [into(o) for o in outs], group, ctx)
    return outs


@register(S2H, "reference")
def seq_to_heads_reference(xs: Sequence[torch.Tensor], group, ctx) -> list[torch.Tensor]:
    """Stock: one blocking all_to_all_single per tensor."""
    return [_stock_seq_to_heads(x, group) for x in xs]


@register(H2S, "reference")
def heads_to_seq_reference(ys: Sequence[torch.Tensor], group, ctx) -> list[torch.Tensor]:
    """Stock: one blocking all_to_all_single per tensor."""
    return [_stock_heads_to_seq(y, group) for y in ys]


def _stock_seq_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """[s/P, b, H, d] -> [s, b, H/P, d]."""
    world = group_info(group)[1]
    send = torch.stack([group_heads(x, g, world) for g in range(world)]).contiguous()  # [P, s/P, b, H/P, d]
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv.reshape((-1,) + tuple(recv.shape[2:]))  # [P*s/P, b, H/P, d]


def _stock_heads_to_seq(y: torch.Tensor, group) -> torch.Tensor:
    """[s, b, H/P, d] -> [s/P, b, H, d]."""
    world = group_info(group)[1]
    recv = torch.empty_like(y)  # row block src = the piece of src: [P, s/P, b, H/P, d]
    dist.all_to_all_single(recv, y.contiguous(), group=group)
    return torch.cat(list(recv.view(world, -1, *y.shape[1:])), dim=2)  # head group src from src


def seq_to_heads(xs: Sequence[torch.Tensor], group, ctx, algo: str = "flash") -> list[torch.Tensor]:
    """[s/P, b, H_i, d] each -> [s, b, H_i/P, d] each (no autograd), by `algo` ("flash" or "reference")."""
    return plain(S2H, algo)(xs, group, ctx)


def heads_to_seq(ys: Sequence[torch.Tensor], group, ctx, algo: str = "flash") -> list[torch.Tensor]:
    """[s, b, H_i/P, d] each -> [s/P, b, H_i, d] each (no autograd), by `algo` ("flash" or "reference")."""
    return plain(H2S, algo)(ys, group, ctx)


@names_operator
class _AllToAll(torch.autograd.Function):
    """Forward one direction (`there`), backward the other (`back`) on the gradients: the dual."""

    @staticmethod
    def forward(ctx, there, back, group, octx, algo, *xs):
        ctx.back, ctx.group, ctx.octx, ctx.algo = back, group, octx, algo
        return tuple(there([x.contiguous() for x in xs], group, octx, algo))

    @staticmethod
    def backward(ctx, *dys):
        return (None,) * 5 + tuple(ctx.back([d.contiguous() for d in dys], ctx.group, ctx.octx, ctx.algo))


class SeqToHeads:
    """Forward seq -> heads; backward heads -> seq of the gradients. `apply(group, octx, algo, *xs)`."""

    @staticmethod
    def apply(group, octx, algo, *xs):
        return _AllToAll.apply(seq_to_heads, heads_to_seq, group, octx, algo, *xs)


class HeadsToSeq:
    """Forward heads -> seq; backward seq -> heads of the gradients. `apply(group, octx, algo, *ys)`."""

    @staticmethod
    def apply(group, octx, algo, *ys):
        return _AllToAll.apply(heads_to_seq, seq_to_heads, group, octx, algo, *ys)
