"""Dry run of a schedule on all ranks at once: matching, deadlock, data dependencies, sums.

`validate(schedules)` raises `ScheduleError` naming the rank, step and slice that break:
- every send is matched by a receive of the same slice, in posting order per (src, dst) pair;
- no deadlock: ranks post a step, wait for the transfers due at its end (a send completes when received;
  a transfer with `lag` L posted at step i is due at step i + L, never past the last step), advance;
- transfers are matched in the executor's posting order: per step, `units` (rising lag, sends first);
- "consume": a slice is computed or forwarded only once it is local or has arrived, and it holds its
  owner's data (`slice.block`);
- "produce": a slice is sent only after this rank computed it and added what arrived for it, and (with
  `accumulate`) an arrival is added only into a slice this rank has computed by then;
- every rank computes each of its `expected` slices exactly once;
- "exchange": a slice is received at most once per step;
- "pipeline" (dispatch, compute, combine in one walk: `local` names the tensors a block brings): a block
  is computed only once all its tensors arrived from its source, its outputs are sent back only after
  it was computed, and every rank ends holding its outputs from every peer;
- every `final` slice ends holding each rank's contribution exactly once (a multiset, so a
  contribution added twice is caught, which a set would hide).
"""
from __future__ import annotations

from collections import Counter, deque
from typing import Sequence

from .step import Schedule, Slice, units


class ScheduleError(ValueError):
    """A schedule that would deadlock, lose data or compute wrongly."""


def _freeze(c: Counter) -> tuple:
    return tuple(sorted(c.items()))


class _Rank:
    def __init__(self, sched: Schedule):
        self.s = sched
        self.i = 0
        self.posted = False
        self.pending: Counter = Counter()  # due step -> transfers posted and not yet matched
        self.have: dict[Slice, Counter] = {x: Counter({sched.rank: 1}) for x in sched.local}
        self.arrived_at: dict[Slice, int] = {}
        self.computed_at: dict[Slice, int] = {}
        self.inbox: list[tuple] = []  # (due step, transfer, content) applied when that step's wait ends
        self.incoming: Counter = Counter()  # slice -> receives posted, not yet waited

    def err(self, msg: str) -> ScheduleError:
        return ScheduleError(f"{self.s.name or self.s.kind}: rank {self.s.rank} step {self.i}: {msg}")


def _post(rk: _Rank, chans: dict) -> None:
    s, step = rk.s, rk.s.steps[rk.i]
    if s.kind == "exchange" and len({t.slice for t in step.recvs}) < len(step.recvs):
        raise rk.err("receives one slice twice in a step (the second arrival would overwrite the first)")
    for lag, sends, recvs in units(step):
        due = rk.i + lag
        if lag < 0 or due >= len(s.steps):
            raise rk.err(f"posts a transfer with lag {lag}: due at step {due}, outside steps 0..{len(s.steps) - 1}")
        for t in sends:
            _check_send(rk, t.slice)
            chans.setdefault((s.rank, t.peer), (deque(), deque()))[0].append((rk, due, t.slice,
                                                                              Counter(rk.have[t.slice])))
        for t in recvs:
            rk.incoming[t.slice] += 1
            chans.setdefault((t.peer, s.rank), (deque(), deque()))[1].append((rk, due, t))
        rk.pending[due] += len(sends) + len(recvs)
    for x in step.compute:
        _compute(rk, x)
    rk.posted = True


def _check_send(rk: _Rank, x: Slice) -> None:
    s = rk.s
    if s.kind == "pipeline" and x not in s.local:
        _pipeline_send(rk, x)
    if s.kind == "consume" and x not in rk.have:
        raise rk.err(f"sends {x.label()} before it is local or has arrived")
    if s.kind == "produce" and rk.computed_at.get(x, rk.i) >= rk.i:
        raise rk.err(f"sends {x.label()} before computing it")
    if s.kind == "produce" and s.accumulate and x in rk.arrived_at and rk.arrived_at[x] >= rk.i:
        raise rk.err(f"sends {x.label()} before adding the partial that arrives for it")
    if s.kind == "produce" and s.accumulate and rk.incoming[x] > 0:
        raise rk.err(f"sends {x.label()} while the partial that arrives for it is still in flight")
    if x not in rk.have:
        raise rk.err(f"sends {x.label()}, which it does not hold")


def _compute(rk: _Rank, x: Slice) -> None:
    s = rk.s
    if x in rk.computed_at:
        raise rk.err(f"computes {x.label()} a second time (first at step {rk.computed_at[x]})")
    rk.computed_at[x] = rk.i
    if s.kind == "consume":
        if x not in rk.have:
            raise rk.err(f"computes {x.label()} before it is local or has arrived")
        if set(rk.have[x]) != {x.block} or rk.have[x][x.block] != 1:
            raise rk.err(f"computes {x.label()} holding {_freeze(rk.have[x])}, not rank {x.block}'s data")
    elif s.kind == "produce":
        rk.have.setdefault(x, Counter())[s.rank] += 1
    elif s.kind == "pipeline":
        for t in sorted({y.tag for y in s.local}):
            need = Slice(x.block, s.rank, t)
            if rk.have.get(need) != Counter({x.block: 1}):
                raise rk.err(f"computes {x.label()} before {need.label()} arrived from rank {x.block}")


def _pipeline_send(rk: _Rank, x: Slice) -> None:
    """An output of block x.block goes back to it only after this rank computed that block."""
    done = [i for c, i in rk.computed_at.items() if (c.block, c.part) == (x.block, rk.s.rank)]
    if not done or min(done) >= rk.i:
        raise rk.err(f"sends {x.label()} before computing block {x.block}")
    rk.have[x] = Counter({rk.s.rank: 1})


def _match(chans: dict) -> bool:
    progressed = False
    for (src, dst), (sends, recvs) in chans.items():
        while sends and recvs:
            (srk, sdue, x, content), (rrk, rdue, t) = sends.popleft(), recvs.popleft()
            if t.slice != x:
                raise ScheduleError(f"rank {src} sends {x.label()} to rank {dst}, which expects "
                                    f"{t.slice.label()} from it at that point")
            srk.pending[sdue] -= 1
            rrk.pending[rdue] -= 1
            rrk.inbox.append((rdue, t, content))
            progressed = True
    return progressed


def _finish_step(rk: _Rank) -> None:
    s = rk.s
    due = [e for e in rk.inbox if e[0] == rk.i]
    rk.inbox = [e for e in rk.inbox if e[0] != rk.i]
    for _, t, content in due:
        x = t.slice
        rk.incoming[x] -= 1
        if x in rk.arrived_at and s.kind != "exchange":
            raise rk.err(f"receives {x.label()} a second time")
        rk.arrived_at[x] = rk.i
        add = s.kind == "exchange" or (s.kind == "produce" and s.accumulate)
        if s.kind == "produce" and s.accumulate and x not in rk.computed_at:
            raise rk.err(f"adds the arrived {x.label()} before computing its own partial of it")
        if add and t.op != "copy":
            rk.have.setdefault(x, Counter()).update(content)
        else:
            rk.have[x] = Counter(content)
    rk.i += 1
    rk.posted = False


def validate(schedules: Sequence[Schedule]) -> None:
    """Dry-run `schedules` (one per rank, index = rank); raise ScheduleError on the first fault."""
    p = len(schedules)
    for r, s in enumerate(schedules):
        if s.rank != r or s.world_size != p:
            raise ScheduleError(f"schedule {r} is for rank {s.rank} of {s.world_size}, not rank {r} of {p}")
    ranks = [_Rank(s) for s in schedules]
    chans: dict = {}
    while any(rk.i < len(rk.s.steps) for rk in ranks):
        progressed = False
        for rk in ranks:
            if rk.i < len(rk.s.steps) and not rk.posted:
                _post(rk, chans)
                progressed = True
        progressed |= _match(chans)
        for rk in ranks:
            if rk.posted and rk.pending[rk.i] == 0:
                _finish_step(rk)
                progressed = True
        if not progressed:
            stuck = [f"rank {rk.s.rank} at step {rk.i}" for rk in ranks if rk.i < len(rk.s.steps)]
            raise ScheduleError("deadlock: " + ", ".join(stuck) + " wait for transfers nobody posts")
    _check_end(ranks, chans, p)


def _check_end(ranks: list[_Rank], chans: dict, p: int) -> None:
    for (src, dst), (sends, recvs) in chans.items():
        if sends or recvs:
            raise ScheduleError(f"unmatched transfers between rank {src} and rank {dst}")
    for rk in ranks:
        missing = [x.label() for x in rk.s.expected if x not in rk.computed_at]
        extra = [x.label() for x in rk.computed_at if rk.s.expected and x not in rk.s.expected]
        if missing or extra:
            raise rk.err(f"never computes {missing}" if missing else f"computes unexpected {extra}")
        if rk.s.kind == "pipeline":
            _pipeline_end(rk, p)
        for x in rk.s.final:
            if rk.have.get(x) != Counter({q: 1 for q in range(p)}):
                raise rk.err(f"ends with {x.label()} = {_freeze(rk.have.get(x, Counter()))}, "
                             f"not every rank's part exactly once")


def _pipeline_end(rk: _Rank, p: int) -> None:
    """Every peer's output of this rank's tokens arrived, from that peer."""
    s = rk.s
    outs = {t.slice.tag for st in s.steps for t in st.sends if t.slice not in s.local}
    for e in range(p):
        for t in sorted(outs) if e != s.rank else ():
            if rk.have.get(Slice(s.rank, e, t)) != Counter({e: 1}):
                raise rk.err(f"ends without the output {Slice(s.rank, e, t).label()} from rank {e}")
