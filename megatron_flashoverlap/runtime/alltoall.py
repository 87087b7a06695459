"""All-to-all as pairwise steps on the one executor (schedules/alltoall.py): handlers and the pipeline API.

    produce_all_to_all(makes, shapes, ...)   before attention: x_s [s/P, b, H, d] -> x_h [s, b, H/P, d]
        step i PRODUCES the piece of the peer of step i+1 while the piece of step i flies; the own piece
        is produced last, straight into its rows of x_h (never sent):
            comm    |          | piece -> r+1 | piece -> r+2 | ... |
            compute | make(r+1) | make(r+2)    | make(r+3)    | ... | make(r) (own, last)
        `make(dst) -> [s/P, b, H/P, d]`: a copy of head group dst, or the QKV projection of that group.
        Arrived pieces land in their row block of x_h: block src.
    consume_all_to_all(ys, uses, ...)        after attention: y_h [s, b, H/P, d] -> pieces [s/P, b, H/P, d]
        the own piece is consumed first, each arrived piece one step later, while the next one flies:
        `use(src, piece)` copies it into head group src, or multiplies it by the projection columns of src.
Several tensors (q, k, v) share one walk: their schedules are merged, one tag per tensor.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from ..schedules import Slice, Transfer, all_to_all_consume, all_to_all_produce
from .context import OverlapContext
from .executor import execute
from .group import group_info
from .pipeline import merged, schedule


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
                 tag: int, ctx: OverlapContext, name: str):
        self.y, self.use, self.rank, self.tag, self.ctx, self.name = y_h.contiguous(), use, rank, tag, ctx, name
        self.rows = y_h.shape[0] // world
        self.held: dict[Slice, torch.Tensor] = {}
        self.turn = 0
        self.slots = (f"{name}.{tag}.0", f"{name}.{tag}.1")
        self.shape = (self.rows,) + tuple(self.y.shape[1:])

    def _mine(self, dst: int) -> torch.Tensor:
        return self.y[dst * self.rows:(dst + 1) * self.rows]

    def send(self, x: Slice) -> torch.Tensor:
        return self._mine(x.part)

    def recv(self, x: Slice) -> torch.Tensor:  # two slots: one consumed while the next one flies
        slot, self.turn = self.turn % 2, self.turn + 1
        self.held[x] = self.ctx.buffer(self.slots[slot], self.shape, self.y.dtype, self.y.device)
        return self.held[x]

    def compute(self, x: Slice) -> None:
        self.use(x.block, self._mine(self.rank) if x.block == self.rank else self.held.pop(x))

    def arrived(self, t: Transfer) -> None:
        pass


def produce_all_to_all(makes: Sequence[Callable[[int], torch.Tensor]], shapes: Sequence[tuple], dtype, device,
                       group, ctx: OverlapContext) -> list[torch.Tensor]:
    """Tensor i: [s/P, b, H_i, d] (never built: shapes[i]) -> [s, b, H_i/P, d], head group g of it made on
    demand by makes[i](g) ([s/P, b, H_i/P, d]); every tensor in one merged walk."""
    rank, world = group_info(group)
    outs, passes = [], {}
    for i, (make, shape) in enumerate(zip(makes, shapes)):
        out_shape = (shape[0] * world, shape[1], shape[2] // world) + tuple(shape[3:])
        outs.append(torch.empty(out_shape, dtype=dtype, device=device))
        passes[i] = ProducePass(make, outs[-1], rank, world, i)
    execute(merged(*(schedule(all_to_all_produce, rank, world, tag=i) for i in range(len(makes)))), group, passes,
            ctx)
    return outs


def consume_all_to_all(ys: Sequence[torch.Tensor], uses: Sequence[Callable[[int, torch.Tensor], None]], group,
                       ctx: OverlapContext, name: str = "a2a.h2s") -> None:
    """Tensor i: y_h [s, b, H_i/P, d]; each piece [s/P, b, H_i/P, d] of source rank src goes to
    uses[i](src, piece), the own piece first; every tensor in one merged walk."""
    rank, world = group_info(group)
    passes = {i: ConsumePass(y, use, rank, world, i, ctx, name) for i, (y, use) in enumerate(zip(ys, uses))}
    execute(merged(*(schedule(all_to_all_consume, rank, world, tag=i) for i in range(len(ys)))), group, passes, ctx)
