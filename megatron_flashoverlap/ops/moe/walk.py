"""One walk of schedules.expert_pipeline: blocks in by source rank, `fn` on each block, outputs back.

    ins[t]   [sum(in_splits), ...]   the tensors this rank sends (block d of rows for rank d)
    got      [sum(out_splits), ...]  the same tensors as they arrive (block s from rank s; own block read in place)
    outs[k]  [sum(in_splits), ...]   fn's outputs, back where the rows of ins came from (own block written in place)
    fn(key, blocks, counts) -> outputs of one block: key = (src, half); counts = rows per local expert
The own block is cut once, at `own_cut` rows (its half A runs first, half B last: schedules.expert_pipeline).
Transfers of zero rows are dropped from the schedule: both ends know every split, so both drop the same.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from ...runtime.executor import execute
from ...schedules import Slice, Step, Transfer, expert_pipeline
from .exchange import offsets


@dataclass(frozen=True)
class Plan:
    """The split sizes of one MoE layer call on one rank (group rank `rank` of `world`).
    counts[s][e]: rows of source rank s for local expert e (stock's num_global_tokens_per_local_expert)."""

    rank: int
    world: int
    in_splits: tuple[int, ...]
    counts: tuple[tuple[int, ...], ...]

    @property
    def out_splits(self) -> tuple[int, ...]:
        return tuple(sum(c) for c in self.counts)

    @property
    def own_cut(self) -> int:
        """Half A of the own block: its first half of the rows (rounded down)."""
        return self.out_splits[self.rank] // 2

    def chunk_counts(self, src: int, half: int) -> list[int]:
        """Rows per local expert of block src (half 0 = whole block, except the own block's halves)."""
        c = list(self.counts[src])
        if src != self.rank:
            return c
        first, left = [], self.own_cut
        for n in c:
            first.append(min(n, left))
            left -= first[-1]
        return first if half == 0 else [n - a for n, a in zip(c, first)]


@functools.lru_cache(maxsize=256)
def _steps(rank: int, world: int, ins: int, outs: int, sends_to: tuple, recvs_from: tuple) -> tuple[Step, ...]:
    """The schedule without transfers of zero rows: sends_to[d] (rows for d), recvs_from[s] (rows from s)."""
    def keep(t: Transfer, sending: bool) -> bool:
        dispatch = t.slice.tag < ins  # dispatch: peer gets / gives its tokens; combine: the reverse
        return (sends_to if dispatch == sending else recvs_from)[t.peer] > 0

    return tuple(Step(tuple(t for t in s.sends if keep(t, True)), tuple(t for t in s.recvs if keep(t, False)),
                      s.compute) for s in expert_pipeline(rank, world, ins=ins, outs=outs).steps)


class _Pass:
    """The handler of every tag of one walk (tag < ins: a tensor in; ins <= tag < ins+outs: a tensor out)."""

    def __init__(self, plan: Plan, ins, out_like, fn: Callable):
        self.plan, self.ins, self.fn, self.n_in = plan, ins, fn, len(ins)
        self.xo, self.oo = offsets(plan.in_splits), offsets(plan.out_splits)
        rows_in = sum(plan.out_splits)
        self.got = [x.new_empty((rows_in,) + tuple(x.shape[1:])) for x in ins]
        self.outs = [like.new_empty(like.shape) for like in out_like]
        self.ready: dict[tuple[int, int], torch.Tensor] = {}

    def _rows(self, t: torch.Tensor, off: list[int], b: int) -> torch.Tensor:
        return t[off[b]:off[b + 1]]

    def send(self, x: Slice) -> torch.Tensor:
        if x.tag < self.n_in:  # my tokens for rank x.part
            return self._rows(self.ins[x.tag], self.xo, x.part)
        return self.ready.pop((x.block, x.tag))  # the output of rank x.block's block

    def recv(self, x: Slice) -> torch.Tensor:
        if x.tag < self.n_in:
            return self._rows(self.got[x.tag], self.oo, x.block)
        return self._rows(self.outs[x.tag - self.n_in], self.xo, x.part)

    def compute(self, x: Slice) -> None:
        src, r = x.block, self.plan.rank
        if src == r:
            return self._own(0 if x.tag == self.n_in else 1)
        if self.plan.out_splits[src] == 0:
            return None
        blocks = [self._rows(a, self.oo, src) for a in self.got]
        for k, y in enumerate(self.fn((src, 0), blocks, self.plan.chunk_counts(src, 0))):
            self.ready[(src, self.n_in + k)] = y.contiguous()
        return None

    def _own(self, half: int) -> None:
        """Half A (rows [0, cut)) or B (rows [cut, n)) of the own block: read from ins, written into outs."""
        base, n, cut = self.xo[self.plan.rank], self.plan.out_splits[self.plan.rank], self.plan.own_cut
        lo, hi = (base, base + cut) if half == 0 else (base + cut, base + n)
        if hi == lo:
            return
        ys = self.fn((self.plan.rank, half), [t[lo:hi] for t in self.ins], self.plan.chunk_counts(self.plan.rank, half))
        for out, y in zip(self.outs, ys):
            out[lo:hi].copy_(y)

    def arrived(self, t: Transfer) -> None:
        pass


def walk(plan: Plan, group, ctx, ins: Sequence[torch.Tensor], out_like: Sequence[torch.Tensor],
         fn: Callable) -> list[torch.Tensor]:
    """Run one fused walk (module docstring) -> outs, laid out like ins."""
    ins = [t.contiguous() for t in ins]
    h = _Pass(plan, ins, out_like, fn)
    steps = _steps(plan.rank, plan.world, len(ins), len(out_like), plan.in_splits, plan.out_splits)
    execute(steps, group, {t: h for t in range(len(ins) + len(out_like) + 1)}, ctx)
    return h.outs
