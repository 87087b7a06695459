"""Expert-parallel all-to-all-v: Megatron's alltoall dispatcher exchange, on the one executor or stock.

    x [sum(in_splits), h]  ->  out [sum(out_splits), h]
        rows of x for rank d:    block d of x   (in_splits[d] rows; the dispatcher's permuted order)
        rows of out from rank s: block s of out (out_splits[s] rows: the output is laid out by source rank)

"flash" / "exchange" (one function: a bare exchange has no experts to fuse; moe.algo "flash" fuses the
experts into the walk in fused.py, "exchange" is this exchange with the experts after it): the P-1 pairwise steps of schedules.alltoall (step i: send to r+i, receive from r-i), posted
asynchronously; transfers of zero rows are dropped from the schedule (both ends know the sizes, so every
rank drops the same pairs). Two orders, the duals of each other:
    DISPATCH  own block first (all_to_all_consume): `use(src, rows)` sees each block the step after it
              arrived, while the next one flies.
            comm    | blk <- r-1 | blk <- r-2 | ... |
            compute | use(r)     | use(r-1)   | ... | use(r+1)
    COMBINE   own block last (all_to_all_produce): `make(dst)` makes the block of the peer of step i+1
              while step i flies; the own block is made last, straight into out (never sent).
            comm    |          | blk -> r+1 | blk -> r+2 | ... |
            compute | make(r+1) | make(r+2)  | make(r+3)  | ... | make(r)
"reference": one blocking all_to_all_single (stock's collective). Both are exact: rows are moved, never summed.
Backward is the dual: the reverse exchange (splits swapped), COMBINE order for DISPATCH and vice versa.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.distributed as dist

from ...runtime import group_info, names_operator
from ...runtime.executor import execute
from ...schedules import Schedule, Slice, Step, Transfer, all_to_all_consume, all_to_all_produce
from ..registry import check_algo, forced, plain, register

OP = "expert_all_to_all"
DISPATCH, COMBINE = "dispatch", "combine"
_DUAL = {DISPATCH: COMBINE, COMBINE: DISPATCH}


def offsets(splits: Sequence[int]) -> list[int]:
    """[0, n0, n0+n1, ...]: where each rank's block starts (and the end)."""
    out = [0]
    for n in splits:
        out.append(out[-1] + n)
    return out


def _drop_empty(sched: Schedule, in_splits, out_splits) -> tuple[Step, ...]:
    """The schedule's steps without transfers of zero rows (send to d: in_splits[d]; recv from s: out_splits[s])."""
    def keep_send(t: Transfer) -> bool:
        return in_splits[t.peer] > 0

    def keep_recv(t: Transfer) -> bool:
        return out_splits[t.peer] > 0
    return tuple(Step(tuple(filter(keep_send, s.sends)), tuple(filter(keep_recv, s.recvs)), s.compute)
                 for s in sched.steps)


class _BlocksPass:
    """Handler of one exchange: send(Slice(r, d)) -> x block d; recv(Slice(s, r)) -> out block s (in place)."""

    def __init__(self, x, out, in_splits, out_splits, rank, use=None, make=None):
        self.x, self.out, self.rank, self.use, self.make = x, out, rank, use, make
        self.xo, self.oo = offsets(in_splits), offsets(out_splits)
        self.ready: dict[Slice, torch.Tensor] = {}
        self.tag = 0

    def _x(self, d: int) -> torch.Tensor:
        return self.x[self.xo[d]:self.xo[d + 1]]

    def _out(self, s: int) -> torch.Tensor:
        return self.out[self.oo[s]:self.oo[s + 1]]

    def send(self, t: Slice) -> torch.Tensor:
        return self.ready.pop(t) if t in self.ready else self._x(t.part)

    def recv(self, t: Slice) -> torch.Tensor:
        return self._out(t.block)

    def compute(self, t: Slice) -> None:
        if self.make is not None:  # COMBINE: make the block of dst (own: straight into out)
            piece = self.make(t.part)
            if t.part == self.rank:
                self._out(self.rank).copy_(piece)
            else:
                self.ready[t] = piece.contiguous()
            return
        if t.block == self.rank:  # DISPATCH: the own block is never sent
            self._out(self.rank).copy_(self._x(self.rank))
        if self.use is not None:
            self.use(t.block, self._out(t.block))

    def arrived(self, t: Transfer) -> None:
        pass


@register(OP, "flash")
@register(OP, "exchange")
def all_to_all_v_flash(x: torch.Tensor, out_splits, in_splits, group, ctx, *, order: str = DISPATCH,
                       use: Callable | None = None, make: Callable | None = None) -> torch.Tensor:
    """x [sum(in_splits), h] -> out [sum(out_splits), h] on pairwise steps (module docstring)."""
    rank, world = group_info(group)
    x = x.contiguous()
    out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
    if order == COMBINE and make is None:
        starts = offsets(in_splits)
        make = lambda d: x[starts[d]:starts[d + 1]]  # noqa: E731  the plain copy
    sched = (all_to_all_consume if order == DISPATCH else all_to_all_produce)(rank, world)
    handler = _BlocksPass(x, out, in_splits, out_splits, rank, use=use, make=make)
    execute(_drop_empty(sched, in_splits, out_splits), group, {0: handler}, ctx)
    return out


@register(OP, "reference")
def all_to_all_v_reference(x: torch.Tensor, out_splits, in_splits, group, ctx, *, order: str = DISPATCH,
                           use: Callable | None = None, make: Callable | None = None) -> torch.Tensor:
    """Stock: one blocking all_to_all_single (order, use and make are ignored: nothing runs between)."""
    x = x.contiguous()
    out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x, list(out_splits), list(in_splits), group=group)
    return out


@names_operator
class ExpertAllToAll(torch.autograd.Function):
    """forward out = A2Av(x; in -> out splits) in `order`; backward dx = A2Av(dout; out -> in) in the dual order."""

    @staticmethod
    def forward(fctx, x, out_splits, in_splits, group, ctx, algo, order):
        fctx.args = (out_splits, in_splits, group, ctx, algo, order)
        return plain(OP, algo)(x, out_splits, in_splits, group, ctx, order=order)

    @staticmethod
    def backward(fctx, dout):
        out_splits, in_splits, group, ctx, algo, order = fctx.args
        dx = plain(OP, algo)(dout, in_splits, out_splits, group, ctx, order=_DUAL[order])
        return dx, None, None, None, None, None, None


def _sizes(splits, rows: int, world: int, what: str) -> list[int]:
    """Split sizes as ints (a numpy array, tensor or list); None: equal blocks of rows / world."""
    if splits is None:
        if rows % world:
            raise ValueError(f"{OP}: {rows} rows do not split evenly over {world} ranks; pass {what}")
        return [rows // world] * world
    sizes = [int(n) for n in (splits.tolist() if hasattr(splits, "tolist") else splits)]
    if len(sizes) != world or min(sizes) < 0:
        raise ValueError(f"{OP}: {what} must hold {world} sizes >= 0 (one per rank of the group), got {sizes}")
    return sizes


def expert_all_to_all(x: torch.Tensor, output_splits, input_splits, group, ctx, *, algo: str = "flash",
                      order: str = DISPATCH) -> torch.Tensor:
    """The public wrapper (megatron's `all_to_all(group, x, output_splits, input_splits)` argument order):
    x [sum(input_splits), h] -> [sum(output_splits), h], differentiable; algo in config.MOE_ALGOS."""
    check_algo(OP, algo)
    if order not in _DUAL:
        raise ValueError(f"{OP}: order must be {DISPATCH!r} (own block first) or {COMBINE!r} (own block last)")
    world = group_info(group)[1]
    if world == 1:
        return x
    ins = _sizes(input_splits, x.shape[0], world, "input_splits")
    if sum(ins) != x.shape[0]:
        raise ValueError(f"{OP}: input_splits {ins} sum to {sum(ins)}, but x has {x.shape[0]} rows")
    outs = _sizes(output_splits, x.shape[0], world, "output_splits")
    return ExpertAllToAll.apply(x, outs, ins, group, ctx, "reference" if forced() else algo, order)
