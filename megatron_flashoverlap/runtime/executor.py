"""The one executor: walks a step list, posts each step's transfers, runs its compute, waits.

Timeline of one step (the compute slices overlap the step's transfers; arrivals are handled after):

    comm    |== send/recv step i ==|        |== send/recv step i+1 ==|
    compute |-- slice(s) step i --|  wait   |-- slice(s) step i+1 --|  wait

`handlers` maps a slice tag to an object with `send(slice) -> Tensor`, `recv(slice) -> Tensor`,
`compute(slice)` and `arrived(transfer)`; several passes (e.g. dgrad RS and wgrad AG) share one walk.
Posting and waiting go through the group's transport (runtime/transport.py): untimed, stream-ordered
waits on NCCL; timed waits with PeerTimeoutError / PeerLostError on gloo.

Host cost: a step list is prepared once (`prepare`: flat tuples of tags, slices and peers, cached by
the identity of the step tuple, which the pipeline's schedule caches keep alive), and the trace's clock
is read only when `ctx.trace` is set.
"""
from __future__ import annotations

import time
from typing import Mapping, Sequence

from ..schedules import Step
from .context import OverlapContext
from .transport import PeerError, PeerLostError, PeerTimeoutError, link

__all__ = ["PeerError", "PeerLostError", "PeerTimeoutError", "execute", "prepare"]
_PLANS: dict = {}
_MAX_PLANS = 1024  # prepared step lists kept; past that the cache starts over


class Prepared:
    """One step, flattened for the walk: (tag, slice) of sends, receives, compute; arrivals (tag, transfer)."""

    __slots__ = ("sends", "send_peers", "recvs", "recv_peers", "compute", "arrivals", "ops", "labels", "where")

    def __init__(self, i: int, step: Step):
        self.sends = tuple((t.slice.tag, t.slice) for t in step.sends)
        self.send_peers = tuple(t.peer for t in step.sends)
        self.recvs = tuple((t.slice.tag, t.slice) for t in step.recvs)
        self.recv_peers = tuple(t.peer for t in step.recvs)
        self.compute = tuple((x.tag, x) for x in step.compute)
        self.arrivals = tuple((t.slice.tag, t) for t in step.recvs)
        self.ops = [("send", p) for p in self.send_peers] + [("receive", p) for p in self.recv_peers]
        self.labels = tuple(x.label() for x in step.compute)
        self.where = f"step {i}"


def prepare(steps: Sequence[Step]) -> tuple[Prepared, ...]:
    """The prepared form of `steps`, cached by identity (the entry keeps `steps` alive: no id reuse)."""
    hit = _PLANS.get(id(steps))
    if hit is not None and hit[0] is steps:
        return hit[1]
    if len(_PLANS) >= _MAX_PLANS:
        _PLANS.clear()
    plan = tuple(Prepared(i, s) for i, s in enumerate(steps))
    _PLANS[id(steps)] = (steps, plan)
    return plan


def execute(steps: Sequence[Step], group, handlers: Mapping, ctx: OverlapContext) -> None:
    """Run `steps` (one rank's schedule) over `group` with the given per-tag handlers."""
    traced = ctx.trace is not None
    lk = None
    for i, st in enumerate(prepare(steps)):
        start = time.perf_counter() if traced else 0.0
        works = ()
        if st.ops:
            out = [handlers[tag].send(x) for tag, x in st.sends]
            inc = [handlers[tag].recv(x) for tag, x in st.recvs]
            lk = lk or link(group, (out or inc)[0].device)
            works = lk.post(i, out, st.send_peers, inc, st.recv_peers)
            if traced:
                ctx.record("post", st.where, start)  # the trace shows step i in flight until its wait ends
        for k, (tag, x) in enumerate(st.compute):
            t = time.perf_counter() if traced else 0.0
            handlers[tag].compute(x)
            if traced:
                ctx.record("compute", st.labels[k], t)
        t = time.perf_counter() if traced else 0.0
        if works:
            lk.wait(works, st.where, st.ops, ctx.timeout)
        if traced:
            ctx.record("wait", st.where, t)
        for tag, tr in st.arrivals:
            handlers[tag].arrived(tr)
