"""Executor handlers: the data side of one ring or exchange pass (see runtime/executor.py).

A handler owns the tensors of one collective and turns the executor's slice callbacks into views
(the all-to-all handlers live in runtime/alltoall.py; runtime/pipeline.py builds and walks them). Each is
built from its pass's schedule (rank, group size, parts) and option objects (runtime/options.py: `Ring`
names its buffers and tags its slices; `Producer` and `Sums` say how a reduce-scatter makes and adds):
- `GatherPass` (consume): shard `x_shard [s/P, ...]`; slice (b, k) is part k of rank b's shard. Arrivals
  land in `gathered [s, ...]` (kept for reuse) or in two ring slots per direction (memory-lean).
  `consume(rows, x_slice)` is the GEMM of the arrived rows; rows index the gathered dim 0.
- `ScatterPass` (produce, accumulate): `producer.fn(rows) -> partial [rows, ...]` for output rows of the
  full [s, ...] tensor (or, with `into`, `producer.fn(rows, out)` writes it into the fp32 slot); partials
  accumulate in `sums.acc` (fp32 for bf16/fp16 inputs) and travel in `sums.wire` (by default the input
  dtype: stock's bytes): a sum is rounded to it only to be sent, an arrival is upcast-added into the
  accumulator; `result()` is this rank's block [s/P, ...] in `sums.out`, rounded once from the accumulator
  (numerics.py).
- `ExchangePass` (all-reduce): `flat [blocks * size]` cut in equal blocks; arrivals add (or copy).
- `TailPass` (compute only): piece i of independent work runs as slice (i, 0); no transfers of its own.
"""
from __future__ import annotations

from typing import Callable

import torch

from .context import OverlapContext
from .options import Producer, Ring, Sums
from ..schedules import Schedule, Slice, Transfer


def part_bounds(n: int, parts: int, k: int) -> tuple[int, int]:
    """Rows [start, stop) of part k when n rows are cut in `parts` (torch.tensor_split's rule)."""
    q, rem = divmod(n, parts)
    start = k * q + min(k, rem)
    return start, start + q + (1 if k < rem else 0)


def chunk_bounds(n: int, k: int) -> list[tuple[int, int]]:
    """The non-empty row ranges of n rows cut in k chunks."""
    return [(a, b) for a, b in (part_bounds(n, k, i) for i in range(k)) if b > a]


def slice_rows(x: Slice, block_rows: int, parts: int) -> tuple[int, int]:
    """Rows of slice x in the full (gathered / pre-scatter) tensor."""
    a, b = part_bounds(block_rows, parts, x.part)
    return x.block * block_rows + a, x.block * block_rows + b


class GatherPass:
    def __init__(self, x_shard: torch.Tensor, consume: Callable[[tuple[int, int], torch.Tensor], None],
                 sched: Schedule, ctx: OverlapContext, ring: Ring, keep_gathered: bool = False):
        rank, world, parts, name = sched.rank, sched.world_size, sched.parts, ring.name
        self.tag = ring.tag
        self.x, self.rank, self.parts, self.consume = x_shard.contiguous(), rank, parts, consume
        self.rows = x_shard.shape[0]
        full = (self.rows * world,) + tuple(x_shard.shape[1:])
        self.gathered = torch.empty(full, dtype=x_shard.dtype, device=x_shard.device) if keep_gathered else None
        if self.gathered is not None:
            self.gathered[rank * self.rows:(rank + 1) * self.rows].copy_(self.x)
        self.ctx, self.name = ctx, name
        self.held: dict[tuple[int, int], torch.Tensor] = {}  # (block, part) -> arrived rows (a tuple: cheap hash)
        self.turn = [0] * parts
        self.bounds = [part_bounds(self.rows, parts, k) for k in range(parts)]
        self.local = [self.x[a:b] for a, b in self.bounds]
        self.shapes = [(b - a,) + tuple(x_shard.shape[1:]) for a, b in self.bounds]
        self.slots = [(f"{name}.{k}.0", f"{name}.{k}.1") for k in range(parts)]  # two ring slots per part
        self.dtype, self.device = x_shard.dtype, x_shard.device

    def view(self, x: Slice) -> torch.Tensor:
        return self.local[x.part] if x.block == self.rank else self.held[(x.block, x.part)]

    def send(self, x: Slice) -> torch.Tensor:
        return self.view(x)

    def recv(self, x: Slice) -> torch.Tensor:
        k = x.part
        if self.gathered is not None:
            lo = x.block * self.rows
            buf = self.gathered[lo + self.bounds[k][0]:lo + self.bounds[k][1]]
        else:  # two slots per part (direction, or hop sub-chunk): a slot is free again once the next hop forwarded it
            slot = self.turn[k] % 2
            self.turn[k] += 1
            buf = self.ctx.buffer(self.slots[k][slot], self.shapes[k], self.dtype, self.device)
        self.held[(x.block, k)] = buf
        return buf

    def compute(self, x: Slice) -> None:
        a, b = self.bounds[x.part]
        lo = x.block * self.rows
        self.consume((lo + a, lo + b), self.view(x))

    def arrived(self, t: Transfer) -> None:
        pass


class ScatterPass:
    def __init__(self, producer: Producer, block: tuple, sums: Sums, sched: Schedule, ctx: OverlapContext,
                 ring: Ring):
        rank, parts, name = sched.rank, sched.parts, ring.name
        self.tag, self.into, self.produce = ring.tag, producer.into, producer.fn
        self.own_into = producer.own_into  # [block_rows, *tail] in acc dtype: the own block is made and summed in place
        self.wire_dtype = sums.wire
        self.rows, self.rank, self.parts = block[0], rank, parts
        self.tail, self.acc_dtype, self.out_dtype, self.device = tuple(block[1:]), sums.acc, sums.out, sums.device
        self.ctx, self.name = ctx, name
        self.acc: dict[Slice, torch.Tensor] = {}
        self.turn = [0] * parts
        self.bounds = [part_bounds(self.rows, parts, k) for k in range(parts)]
        self.shapes = [(b - a,) + self.tail for a, b in self.bounds]
        self.slots = [(f"{name}.acc.{k}.0", f"{name}.acc.{k}.1") for k in range(parts)]
        self.recv_names = [f"{name}.recv.{k}" for k in range(parts)]
        self.send_names = [f"{name}.send.{k}" for k in range(parts)]

    def _shape(self, x: Slice) -> tuple:
        return self.shapes[x.part]

    def compute(self, x: Slice) -> None:
        a, b = self.bounds[x.part]
        if x.block == self.rank and self.own_into is not None:  # never sent: it is summed where it ends up
            buf = self.own_into[a:b]
        else:
            slot = self.turn[x.part] % 2  # a partial is sent one step after it is made: two slots suffice
            self.turn[x.part] += 1
            buf = self.ctx.buffer(self.slots[x.part][slot], self.shapes[x.part], self.acc_dtype, self.device)
        rows = (x.block * self.rows + a, x.block * self.rows + b)
        if self.into:
            self.produce(rows, buf)
        else:
            buf.copy_(self.produce(rows))
        self.acc[x] = buf

    def send(self, x: Slice) -> torch.Tensor:
        acc = self.acc.pop(x)
        if self.wire_dtype == acc.dtype:
            return acc
        # one send per part in flight, waited before the next is made: one slot per part
        wire = self.ctx.buffer(self.send_names[x.part], acc.shape, self.wire_dtype, self.device)
        return wire.copy_(acc)  # the fp32 sum rounded to the wire dtype, once per hop

    def recv(self, x: Slice) -> torch.Tensor:
        return self.ctx.buffer(self.recv_names[x.part], self.shapes[x.part], self.wire_dtype, self.device)

    def arrived(self, t: Transfer) -> None:
        self.acc[t.slice].add_(self.recv(t.slice))  # upcast-add: wire dtype into the acc_dtype sum

    def result(self) -> torch.Tensor:
        if self.own_into is not None:
            return self.own_into
        own = [self.acc[Slice(self.rank, k, self.tag)] for k in range(self.parts)]
        return torch.cat(own, dim=0).to(self.out_dtype) if len(own) > 1 else own[0].to(self.out_dtype, copy=True)


class ExchangePass:
    """Handler of an "exchange" schedule: `flat [blocks * size]` cut in equal blocks; arrivals add or copy."""

    def __init__(self, flat: torch.Tensor, blocks: int, ctx: OverlapContext, name: str = "ar", tag: int = 0):
        self.flat, self.size, self.ctx, self.name, self.tag = flat, flat.numel() // blocks, ctx, name, tag
        self.recv_names = [f"{name}.recv.{b}" for b in range(blocks)]

    def view(self, x: Slice) -> torch.Tensor:
        return self.flat[x.block * self.size:(x.block + 1) * self.size]

    def send(self, x: Slice) -> torch.Tensor:
        return self.view(x)

    def recv(self, x: Slice) -> torch.Tensor:  # one scratch per block: a step receives a block at most once
        return self.ctx.buffer(self.recv_names[x.block], (self.size,), self.flat.dtype, self.flat.device)

    def compute(self, x: Slice) -> None:
        pass

    def arrived(self, t: Transfer) -> None:
        got = self.recv(t.slice)
        self.view(t.slice).copy_(got) if t.op == "copy" else self.view(t.slice).add_(got)


class TailPass:
    """Compute-only handler: slice (i, 0) runs piece i of independent work `fn(i)` (no transfers)."""

    def __init__(self, fn: Callable[[int], None], tag: int = 0):
        self.fn, self.tag = fn, tag

    def compute(self, x: Slice) -> None:
        self.fn(x.block)
