"""The one executor: walks a step list, posts each step's transfers, runs its compute, waits.

Timeline of one step (the compute slices overlap the step's transfers; arrivals are handled after):

    comm    |== send/recv step i ==|        |== send/recv step i+1 ==|
    compute |-- slice(s) step i --|  wait   |-- slice(s) step i+1 --|  wait

`handlers` maps a slice tag to an object with `send(slice) -> Tensor`, `recv(slice) -> Tensor`,
`compute(slice)` and `arrived(transfer)`; several passes (e.g. dgrad RS and wgrad AG) share one walk.
"""
from __future__ import annotations

import time
from typing import Mapping, Sequence

import torch.distributed as dist

from ..schedules import Step, Transfer
from .context import OverlapContext
from .group import global_rank


class PeerTimeoutError(RuntimeError):
    """A peer did not complete a transfer within the context's timeout."""


def _post(step: Step, group, handlers: Mapping) -> list:
    ops = [dist.P2POp(dist.isend, handlers[t.slice.tag].send(t.slice), global_rank(group, t.peer), group)
           for t in step.sends]
    ops += [dist.P2POp(dist.irecv, handlers[t.slice.tag].recv(t.slice), global_rank(group, t.peer), group)
            for t in step.recvs]
    return dist.batch_isend_irecv(ops) if ops else []


def _wait(works: list, step_index: int, step: Step, ctx: OverlapContext) -> None:
    start = time.perf_counter()
    for w in works:
        try:
            ok = w.wait(ctx.timeout)
        except RuntimeError as e:
            raise _timeout(step_index, step, ctx) from e
        if ok is False:
            raise _timeout(step_index, step, ctx)
    ctx.record("wait", f"step {step_index}", start)


def _timeout(i: int, step: Step, ctx: OverlapContext) -> PeerTimeoutError:
    peers = sorted({t.peer for t in step.sends + step.recvs})
    return PeerTimeoutError(
        f"step {i}: group ranks {peers} did not complete their transfers within {ctx.timeout}. A peer died "
        f"or the ranks called different operators or shapes; the process group is unusable now, restart "
        f"the job (the limit is OverlapContext(timeout=...), by default the configured timeout_s)")


def execute(steps: Sequence[Step], group, handlers: Mapping, ctx: OverlapContext) -> None:
    """Run `steps` (one rank's schedule) over `group` with the given per-tag handlers."""
    for i, step in enumerate(steps):
        start = time.perf_counter()
        works = _post(step, group, handlers)
        if works:
            ctx.record("post", f"step {i}", start)  # the trace shows step i in flight from here to its wait's end
        for x in step.compute:
            start = time.perf_counter()
            handlers[x.tag].compute(x)
            ctx.record("compute", x.label(), start)
        _wait(works, i, step, ctx)
        for t in step.recvs:
            handlers[t.slice.tag].arrived(t)
