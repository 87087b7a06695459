"""Schedules as data: what each rank sends, receives and computes at each step.

A schedule is a tuple of `Step`s for one rank. The executor (runtime/executor.py) runs a step as:

    post every send and recv of the step (async)  ->  run the step's compute slices  ->  wait  ->  arrived(recvs)

so the compute of a step overlaps the transfers of the same step. A transfer with `lag` L > 0 is posted
at its step i but waited (and, if a receive, handed to `arrived`) only at the end of step i + L: it stays
in flight under L more compute phases (a hop cut in sub-chunks, all posted ahead, each waited just
before the slice that needs it). A step posts its transfers as units, one per lag, in rising lag
(`units`): sends then receives within a unit, each unit its own post (its own works to wait on). A `Slice` names a piece of data by
`block` (a rank-sized block of the collective's tensor) and `part` (a sub-piece: the half of a
bidirectional ring, a chunk of a slicing baseline). `tag` separates several schedules merged into one
(e.g. the dgrad reduce-scatter and the wgrad all-gather of one backward pass).

No torch.distributed here: schedules are pure functions of (rank, world_size, ...), checked without processes.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, order=True)
class Slice:
    """One piece of the collective's data: rank-block `block`, sub-piece `part` of `parts`."""

    block: int
    part: int = 0
    tag: int = 0

    def label(self, always_part: bool = False) -> str:
        p = f".{self.part}" if self.part or always_part else ""
        t = f"#{self.tag}" if self.tag else ""
        return f"{self.block}{p}{t}"


@dataclass(frozen=True)
class Transfer:
    """A point-to-point message of `slice` to (send) or from (recv) group rank `peer`."""

    peer: int
    slice: Slice
    op: str = ""  # recv only: "" = the schedule's default combine, "copy" = replace what is held
    lag: int = 0  # waited at the end of step (posting step + lag); the sender and receiver give it the same


@dataclass(frozen=True)
class Step:
    """Transfers posted together, and the compute slices that run while they are in flight."""

    sends: tuple[Transfer, ...] = ()
    recvs: tuple[Transfer, ...] = ()
    compute: tuple[Slice, ...] = ()

    @property
    def has_comm(self) -> bool:
        return bool(self.sends or self.recvs)


@dataclass(frozen=True)
class Schedule:
    """The steps of one rank. `kind` says what the data dependencies mean:

    - "consume" (all-gather + GEMM): a slice is computed or forwarded only once it is local or has arrived;
    - "produce" (GEMM + reduce-scatter, all-to-all): a slice is sent only after this rank computed it
      (and, where it also arrived, after the arrived partial was added: `accumulate`);
    - "exchange" (all-reduce): slices are sent, received and combined; `compute` names the combine.
    """

    kind: str
    rank: int
    world_size: int
    steps: tuple[Step, ...]
    parts: int = 1
    accumulate: bool = False
    name: str = ""
    local: tuple[Slice, ...] = field(default=())  # slices present before step 0 ("consume"/"exchange")
    expected: tuple[Slice, ...] = field(default=())  # slices this rank must compute exactly once
    final: tuple[Slice, ...] = field(default=())  # slices that must end holding every rank's part once

    def __len__(self) -> int:
        return len(self.steps)


def units(step: Step) -> tuple[tuple[int, tuple[Transfer, ...], tuple[Transfer, ...]], ...]:
    """The posting order of a step: (lag, sends, recvs) per distinct lag, rising; schedule order within."""
    lags = sorted({t.lag for t in step.sends + step.recvs})
    return tuple((g, tuple(t for t in step.sends if t.lag == g), tuple(t for t in step.recvs if t.lag == g))
                 for g in lags)


def merge(*schedules: Schedule) -> tuple[Step, ...]:
    """Zip several schedules of one rank step by step (their slices must carry distinct tags)."""
    n = max(len(s.steps) for s in schedules)
    out = []
    for i in range(n):
        parts = [s.steps[i] for s in schedules if i < len(s.steps)]
        out.append(Step(
            sends=tuple(t for p in parts for t in p.sends),
            recvs=tuple(t for p in parts for t in p.recvs),
            compute=tuple(c for p in parts for c in p.compute),
        ))
    return tuple(out)
