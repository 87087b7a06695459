"""The one executor: walks a step list, posts each step's transfers, runs its compute, waits.

Timeline of one step (the compute slices overlap the step's transfers; arrivals are handled after):

    comm    |== send/recv step i ==|        |== send/recv step i+1 ==|
    compute |-- slice(s) step i --|  wait   |-- slice(s) step i+1 --|  wait

`handlers` maps a slice tag to an object with `send(slice) -> Tensor`, `recv(slice) -> Tensor`,
`compute(slice)` and `arrived(transfer)`; several passes (e.g. dgrad RS and wgrad AG) share one walk.
Posting and waiting go through the group's transport (runtime/transport.py): untimed, stream-ordered
waits on NCCL; timed waits with PeerTimeoutError / PeerLostError on gloo.

Transfers with a `lag` (schedules/step.py: a hop cut in sub-chunks, posted ahead) are posted as their own
unit, one post per lag, and waited at the end of the step they are due in, in posting order:

    comm    |== sub-chunk 0 ==|== sub-chunk 1 ==|          (both posted at step 0)
    compute |-- own shard, step 0 --| wait 0 |-- slice of sub-chunk 0 --| wait 1 |-- sub-chunk 1 --|

A walk may hand back its last step's waits (`defer_last=True`): everything is posted and computed, and the
returned `Deferred.finish()` waits on the last step's transfers and runs their arrivals later, e.g. a DP
reduce-scatter ring whose last hop is waited at the next ring or at Megatron's finish_grad_sync, so the
backward between them is not held by a peer running behind (megatron/ddp/grad_sync.py). The handlers' buffers must
stay untouched until then (same context: finish before the next walk that uses the same buffer names).

Host cost: a step list is prepared once (`prepare`: flat tuples of tags, slices and peers, cached by
the identity of the step tuple, which the pipeline's schedule caches keep alive), and the trace's clock
is read only when `ctx.trace` is set.
"""
from __future__ import annotations

import time
from typing import Mapping, Sequence

from ..schedules import Step
from ..schedules.step import units
from .context import OverlapContext
from .transport import PeerError, PeerLostError, PeerTimeoutError, link

__all__ = ["Deferred", "PeerError", "PeerLostError", "PeerTimeoutError", "execute", "prepare"]
_PLANS: dict = {}
_MAX_PLANS = 1024  # prepared step lists kept; past that the cache starts over


class Unit:
    """One post of a step (its transfers of one lag): (tag, slice) of sends and receives, their peers."""

    __slots__ = ("sends", "send_peers", "recvs", "recv_peers", "arrivals", "ops", "where")

    def __init__(self, i: int, lag: int, sends, recvs):
        self.sends = tuple((t.slice.tag, t.slice) for t in sends)
        self.send_peers = tuple(t.peer for t in sends)
        self.recvs = tuple((t.slice.tag, t.slice) for t in recvs)
        self.recv_peers = tuple(t.peer for t in recvs)
        self.arrivals = tuple((t.slice.tag, t) for t in recvs)
        self.ops = [("send", p) for p in self.send_peers] + [("receive", p) for p in self.recv_peers]
        self.where = f"step {i}" if not lag else f"step {i} (waited at step {i + lag})"


class Prepared:
    """One step, flattened for the walk: its posts (`units`, ids `first..` in walk order), its compute
    (tag, slice), and the ids of the units waited at its end (`due`, in posting order)."""

    __slots__ = ("units", "first", "compute", "labels", "where", "due")

    def __init__(self, i: int, step: Step, first: int):
        self.units = tuple(Unit(i, lag, sends, recvs) for lag, sends, recvs in units(step))
        self.first = first
        self.compute = tuple((x.tag, x) for x in step.compute)
        self.labels = tuple(x.label() for x in step.compute)
        self.where = f"step {i}"
        self.due: tuple[int, ...] = ()


def _plan(steps: Sequence[Step]) -> tuple[tuple[Prepared, ...], tuple[Unit, ...]]:
    plan, first = [], 0
    for i, s in enumerate(steps):
        plan.append(Prepared(i, s, first))
        first += len(plan[-1].units)
    due: list[list[int]] = [[] for _ in plan]
    for i, (st, s) in enumerate(zip(plan, steps)):
        for k, (lag, _, _) in enumerate(units(s)):
            if i + lag >= len(plan):
                raise ValueError(f"{st.where}: a transfer of lag {lag} is due after the last step; validate the "
                                 f"schedule (schedules.validate)")
            due[i + lag].append(st.first + k)
    for st, d in zip(plan, due):
        st.due = tuple(d)
    return tuple(plan), tuple(u for st in plan for u in st.units)


def prepare(steps: Sequence[Step]) -> tuple[tuple[Prepared, ...], tuple[Unit, ...]]:
    """The prepared form of `steps`, cached by identity (the entry keeps `steps` alive: no id reuse)."""
    hit = _PLANS.get(id(steps))
    if hit is not None and hit[0] is steps:
        return hit[1]
    if len(_PLANS) >= _MAX_PLANS:
        _PLANS.clear()
    plan = _plan(steps)
    _PLANS[id(steps)] = (steps, plan)
    return plan


class Deferred:
    """The waits and arrivals of a walk's last step, run by `finish()` (once; later calls do nothing)."""

    __slots__ = ("_args",)

    def __init__(self, *args):
        self._args = args or None  # Deferred(): nothing left to wait on

    def finish(self) -> None:
        if self._args is not None:
            args, self._args = self._args, None
            _complete(*args)


def _complete(lk, st: Prepared, works: list, all_units, handlers: Mapping, ctx: OverlapContext) -> None:
    """Step st's end: wait on the units due in it (posting order), then hand their arrivals to the handlers."""
    traced = ctx.trace is not None
    t = time.perf_counter() if traced else 0.0
    for d in st.due:
        lk.wait(works[d], all_units[d].where, all_units[d].ops, ctx.timeout)
        works[d] = None
    if traced:
        ctx.record("wait", st.where, t)
    for d in st.due:
        for tag, tr in all_units[d].arrivals:
            handlers[tag].arrived(tr)


def execute(steps: Sequence[Step], group, handlers: Mapping, ctx: OverlapContext, *,
            defer_last: bool = False) -> Deferred | None:
    """Run `steps` (one rank's schedule) over `group` with the given per-tag handlers. defer_last: return the
    last step's waits and arrivals as a `Deferred` instead of running them (module docstring)."""
    traced = ctx.trace is not None
    plan, all_units = prepare(steps)
    works: list = [None] * len(all_units)  # in flight: per unit id, posted and not yet waited
    lk = None
    for i, st in enumerate(plan):
        start = time.perf_counter() if traced else 0.0
        for k, u in enumerate(st.units):
            out = [handlers[tag].send(x) for tag, x in u.sends]
            inc = [handlers[tag].recv(x) for tag, x in u.recvs]
            lk = lk or link(group, (out or inc)[0].device)
            works[st.first + k] = lk.post(i, out, u.send_peers, inc, u.recv_peers)
        if traced and st.units:
            ctx.record("post", st.where, start)  # the trace shows step i in flight until its wait ends
        for k, (tag, x) in enumerate(st.compute):
            t = time.perf_counter() if traced else 0.0
            handlers[tag].compute(x)
            if traced:
                ctx.record("compute", st.labels[k], t)
        if defer_last and i == len(plan) - 1:
            return Deferred(lk, st, works, all_units, handlers, ctx)
        _complete(lk, st, works, all_units, handlers, ctx)
    return Deferred() if defer_last else None
