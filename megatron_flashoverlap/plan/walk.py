"""The priced walk: the executor's step semantics (runtime/executor.py) with times instead of tensors.

For each step of one rank's step list:

    post     each unit of the step (its transfers of one lag, `schedules.step.units`), in order, on the ONE
             communication stream, in two parts: its host work (`fixed`: the post itself) starts when posted
             and when the previous unit's host work is done; its bytes (the rest of `transfer`) start when
             its host work is done and the previous unit's bytes are through. A unit posted while the one
             before it is still in flight (hop sub-chunks, a pipeline) hides its post under those bytes; a unit
             posted after waiting on the one before it (a ring's dependent steps) pays both in series.
             `post_blocks` (the CPU proxy: the thread that posts is the one that computes): the compute
             stream resumes only when the post's host work is done
             `worker` units (the CPU proxy's gloo collectives): the host work runs on the backend's worker
             thread, on the rank's one core: the post itself costs the compute stream nothing; where compute
             runs beside it (the step computes after the post, or the unit is waited on a later step) the two
             share the core, each at half speed: the host work takes twice its time and the compute inside
             that span is stretched to match (processor sharing); a unit posted and waited with nothing
             between runs its host work at full speed
    compute  the step's slices, one after another on the compute stream; a slice runs (1 + slowdown) times
             slower while a transfer is in flight beside it (SM / memory contention)
    wait     the units due at this step's end (posted at step i - lag); the compute stream resumes when they
             finished, then their arrivals are handled (e.g. the add of an arrived partial sum: `arrived`)

    comm     |== unit i ==|         |== unit i+1 ==|     (host part then bytes: |h|==== bytes ====|)
    compute  |-- slices i --| wait  |-- slices i+1 --| wait

Every rank is taken to run the same step list at the same times (the rings and the all-to-all are rank-
symmetric), so a receive completes with its matching send; a schedule whose ranks differ (the all-reduce
with a fold) is walked rank by rank and the slowest rank gives the time (collectives.all_reduce).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

from ..schedules import Slice, Step, Transfer
from ..schedules.step import units


@dataclass(frozen=True)
class Prices:
    """compute(slice) -> seconds; transfer(sends, recvs) -> seconds of one post; arrived(recv) -> seconds of its
    handling on the compute stream after the wait (0 by default); label(slice) -> text for a timeline;
    fixed(sends, recvs) -> the part of transfer's seconds that is host work (0 by default: all of it waits for
    the previous unit's bytes); post_blocks: that host work holds the compute stream too (a CPU rank);
    worker(sends, recvs): that host work runs on a worker thread sharing the rank's core with the compute
    instead (module docstring; False by default)."""

    compute: Callable[[Slice], float]
    transfer: Callable[[Sequence[Transfer], Sequence[Transfer]], float]
    arrived: Callable[[Transfer], float] = lambda t: 0.0
    label: Callable[[Slice], str] = lambda s: s.label()
    fixed: Callable[[Sequence[Transfer], Sequence[Transfer]], float] = lambda s, r: 0.0
    post_blocks: bool = False
    worker: Callable[[Sequence[Transfer], Sequence[Transfer]], bool] = lambda s, r: False


@dataclass
class Clock:
    """Where a walk stands: the compute stream's time, the communication stream's, what ran (events: lane, start,
    end, label)."""

    t: float = 0.0
    comm: float = 0.0
    host: float = 0.0  # where the communication stream's host work (a post's fixed cost) is free again
    work: float = 0.0  # compute seconds without contention
    busy: list = field(default_factory=list)  # (start, end) of transfers, in order of posting
    shared: list = field(default_factory=list)  # (start, end) where a worker's host work shares the core
    events: list = field(default_factory=list)


def stretch(t: float, work: float, busy: list, slowdown: float) -> float:
    """End of `work` seconds of compute started at t, slowed by (1 + slowdown) inside the busy intervals."""
    now, left = t, work
    for s, e in busy:
        if e <= now or left <= 0:
            continue
        if s > now:
            if left <= s - now:
                return now + left
            left -= s - now
            now = s
        span = (e - now) / (1.0 + slowdown)
        if left <= span:
            return now + left * (1.0 + slowdown)
        left -= span
        now = e
    return now + left


def run(steps: Sequence[Step], prices: Prices, slowdown: float, clock: Clock | None = None, lane: str = "") -> Clock:
    """Walk one rank's `steps` (module docstring), continuing `clock` (a new one at 0 by default)."""
    c = clock if clock is not None else Clock()
    due: dict[int, list] = {}
    for i, step in enumerate(steps):
        for lag, sends, recvs in units(step):
            whole = prices.transfer(sends, recvs)
            fixed = min(prices.fixed(sends, recvs), whole)
            start = max(c.t, c.host)
            worker = prices.worker(sends, recvs)
            shares = worker and fixed > 0 and bool(step.compute or lag)  # compute beside it: both at half speed
            c.host = start + (2 * fixed if shares else fixed)
            if shares:
                c.shared.append((start, c.host))
            if prices.post_blocks and not worker:
                c.t = c.host
            sent = max(c.host, c.comm)  # where its bytes start
            c.comm = sent + whole - fixed
            c.busy.append((sent if worker else start, c.comm))  # a worker's: its bytes only
            c.events.append(("comm", start, c.comm, lane + _unit_label(sends, recvs)))
            due.setdefault(i + lag, []).append((c.comm, recvs))
        for x in step.compute:
            work = prices.compute(x)
            shared = stretch(c.t, work, c.shared, 1.0) - c.t if c.shared else work
            end = stretch(c.t, shared, c.busy, slowdown)
            if work > 0:
                c.events.append(("compute", c.t, end, lane + prices.label(x)))
            c.t, c.work = end, c.work + work
        for finish, recvs in due.pop(i, ()):
            c.t = max(c.t, finish)
            c.t += sum(prices.arrived(r) for r in recvs)
    if due:
        raise ValueError(f"transfers due after the last step ({sorted(due)}); validate the schedule")
    return c


def _unit_label(sends, recvs) -> str:
    xs = sends or recvs
    return ",".join(t.slice.label() for t in xs[:3]) + ("…" if len(xs) > 3 else "")
