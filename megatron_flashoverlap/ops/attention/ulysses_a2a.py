"""Ulysses all-to-all as pairwise steps on the one executor (schedules/alltoall.py), with compute callbacks.

    seq -> heads (before attention):  x_s [s/P, b, H, d]  ->  x_h [s, b, H/P, d]
        all_to_all_produce: step i PRODUCES the head group of the peer of step i+1 while the piece of step
        i flies; the own group is produced last, straight into its rows of x_h (never sent):
            comm    |          | piece -> r+1 | piece -> r+2 | ... |
            compute | make(r+1) | make(r+2)    | make(r+3)    | ... | make(r) (own, last)
        `make(dst) -> [s/P, b, H/P, d]` is a copy of head group dst (stock-like) or the QKV projection of
        that head group (ulysses_fused.py). Arrived pieces land in their row block of x_h: block src.
    heads -> seq (after attention):   y_h [s, b, H/P, d]  ->  consumed pieces [s/P, b, H/P, d] per src
        all_to_all_consume: the own piece is consumed first, each arrived piece one step later, while the
        next one flies. `use(src, piece)` copies it into head group src (stock-like) or multiplies it by the
        output projection columns of head group src and accumulates (ulysses_fused.py).
Several tensors (q, k, v) share one walk: their schedules are merged, one tag per tensor.
Head group g = heads [g*H/P, (g+1)*H/P); the row block of rank src = rows [src*s/P, (src+1)*s/P).
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.distributed as dist

from ...runtime import execute, group_info
from ...schedules import Slice, Transfer, all_to_all_consume, all_to_all_produce, merge


class ProducePass:
    """Handler of all_to_all_produce for one tensor: out [s, b, ...] gets the piece of src in block src."""

    def __init__(self, make: Callable[[int], torch.Tensor], out: torch.Tensor, rank: int, world: int, tag: int):
        self.make, self.out, self.rank, self.tag = make, out, rank, tag
        self.rows = out.shape[0] // world
        self.ready: dict[Slice, torch.Tensor] = {}

    def _block(self, src: int) -> torch.Tensor:
        return self.out[src * self.rows:(src + 1) * self.rows]

    def compute(self, x: Slice) -> None:
        if x.part == self.rank:
            self._block(self.rank).copy_(self.make(self.rank))
        else:
            self.ready[x] = self.make(x.part).contiguous()

    def send(self, x: Slice) -> torch.Tensor:
        return self.ready.pop(x)

    def recv(self, x: Slice) -> torch.Tensor:
        return self._block(x.block)

    def arrived(self, t: Transfer) -> None:
        pass


class ConsumePass:
    """Handler of all_to_all_consume for one tensor y_h [s, b, ...]: pieces go to `use(src, piece)`."""

    def __init__(self, y_h: torch.Tensor, use: Callable[[int, torch.Tensor], None], rank: int, world: int,
                 tag: int, ctx, name: str):
        self.y, self.use, self.rank, self.tag, self.ctx, self.name = y_h.contiguous(), use, rank, tag, ctx, name
        self.rows = y_h.shape[0] // world
        self.held: dict[Slice, torch.Tensor] = {}
        self.turn = 0

    def _mine(self, dst: int) -> torch.Tensor:
        return self.y[dst * self.rows:(dst + 1) * self.rows]

    def send(self, x: Slice) -> torch.Tensor:
        return self._mine(x.part)

    def recv(self, x: Slice) -> torch.Tensor:  # two slots: one consumed while the next one flies
        slot, self.turn = self.turn % 2, self.turn + 1
        shape = (self.rows,) + tuple(self.y.shape[1:])
        self.held[x] = self.ctx.buffer(f"{self.name}.{self.tag}.{slot}", shape, self.y.dtype, self.y.device)
        return self.held[x]

    def compute(self, x: Slice) -> None:
        self.use(x.block, self._mine(self.rank) if x.block == self.rank else self.held.pop(x))

    def arrived(self, t: Transfer) -> None:
        pass


def group_heads(t: torch.Tensor, g: int, world: int) -> torch.Tensor:
    """Head group g of t [.., H, d] along dim 2: [.., H/P, d]."""
    n = t.shape[2] // world
    return t[:, :, g * n:(g + 1) * n]


def seq_to_heads(xs: Sequence[torch.Tensor], group, ctx, stock=False) -> list[torch.Tensor]:
    """[s/P, b, H_i, d] each -> [s, b, H_i/P, d] each, in one walk (one tag per tensor).

    stock: one blocking all_to_all_single per tensor instead (the baseline)."""
    if stock:
        return [_stock_seq_to_heads(x, group) for x in xs]
    world = group_info(group)[1]
    makes = [lambda g, x=x: group_heads(x, g, world) for x in xs]
    return produce_heads(makes, [tuple(x.shape) for x in xs], xs[0].dtype, xs[0].device, group, ctx)


def produce_heads(makes, shapes, dtype, device, group, ctx) -> list[torch.Tensor]:
    """Like seq_to_heads, but head group g of tensor i is made on demand by makes[i](g) ([s/P, b, H_i/P, d])
    instead of sliced from a tensor; shapes[i] = [s/P, b, H_i, d] (the tensor that is never built)."""
    rank, world = group_info(group)
    outs, passes = [], {}
    for i, (make, shape) in enumerate(zip(makes, shapes)):
        out_shape = (shape[0] * world, shape[1], shape[2] // world) + tuple(shape[3:])
        outs.append(torch.empty(out_shape, dtype=dtype, device=device))
        passes[i] = ProducePass(make, outs[-1], rank, world, i)
    steps = merge(*(all_to_all_produce(rank, world, tag=i) for i in range(len(makes))))
    execute(steps, group, passes, ctx)
    return outs


def heads_to_seq(ys: Sequence[torch.Tensor], group, ctx, uses=None, stock=False) -> list[torch.Tensor] | None:
    """[s, b, H_i/P, d] each -> [s/P, b, H_i, d] each (or, with `uses`, feed each piece to uses[i])."""
    if stock:
        return [_stock_heads_to_seq(y, group) for y in ys]
    rank, world = group_info(group)
    outs, passes = [], {}
    for i, y in enumerate(ys):
        if uses:
            use = uses[i]
        else:
            out = torch.empty((y.shape[0] // world, y.shape[1], y.shape[2] * world) + tuple(y.shape[3:]),
                              dtype=y.dtype, device=y.device)
            outs.append(out)

            def use(src, piece, out=out):
                group_heads(out, src, world).copy_(piece)
        passes[i] = ConsumePass(y, use, rank, world, i, ctx, "a2a.h2s")
    steps = merge(*(all_to_all_consume(rank, world, tag=i) for i in range(len(ys))))
    execute(steps, group, passes, ctx)
    return None if uses else outs


class SeqToHeads(torch.autograd.Function):
    """Forward seq -> heads; backward heads -> seq of the gradients (the dual)."""

    @staticmethod
    def forward(ctx, group, octx, stock, *xs):
        ctx.group, ctx.octx, ctx.stock = group, octx, stock
        return tuple(seq_to_heads([x.contiguous() for x in xs], group, octx, stock=stock))

    @staticmethod
    def backward(ctx, *dys):
        dys = [d.contiguous() for d in dys]
        return (None, None, None) + tuple(heads_to_seq(dys, ctx.group, ctx.octx, stock=ctx.stock))


class HeadsToSeq(torch.autograd.Function):
    """Forward heads -> seq; backward seq -> heads of the gradients (the dual)."""

    @staticmethod
    def forward(ctx, group, octx, stock, *ys):
        ctx.group, ctx.octx, ctx.stock = group, octx, stock
        return tuple(heads_to_seq([y.contiguous() for y in ys], group, octx, stock=stock))

    @staticmethod
    def backward(ctx, *dxs):
        dxs = [d.contiguous() for d in dxs]
        return (None, None, None) + tuple(seq_to_heads(dxs, ctx.group, ctx.octx, stock=ctx.stock))


def _stock_seq_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """Stock all_to_all_single: [s/P, b, H, d] -> [s, b, H/P, d]."""
    rank, world = group_info(group)
    send = torch.stack([group_heads(x, g, world) for g in range(world)]).contiguous()  # [P, s/P, b, H/P, d]
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv.reshape((-1,) + tuple(recv.shape[2:]))  # [P*s/P, b, H/P, d]


def _stock_heads_to_seq(y: torch.Tensor, group) -> torch.Tensor:
    """Stock all_to_all_single: [s, b, H/P, d] -> [s/P, b, H, d]."""
    rank, world = group_info(group)
    recv = torch.empty_like(y)  # row block src = the piece of src: [P, s/P, b, H/P, d]
    dist.all_to_all_single(recv, y.contiguous(), group=group)
    blocks = recv.view(world, -1, *y.shape[1:])
    return torch.cat(list(blocks), dim=2)  # head group src from src
