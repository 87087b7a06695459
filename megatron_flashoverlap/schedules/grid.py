"""Printed form of a schedule: one row per rank, one column per step.

Cell legend: `[a,b]` slices computed in that step, `x>p` slice x sent to rank p, `x<p` slice x received
from rank p (added, for an exchange), `x<=p` received from rank p replacing what is held (`op="copy"`), a
suffix `@s` a transfer posted here but waited at the end of step s (`lag`). A slice label is `block[.part][#tag]`.
"""
from __future__ import annotations

from typing import Sequence

from .step import Schedule, Step


def _cell(i: int, step: Step, ap: bool) -> str:
    due = lambda t: f"@{i + t.lag}" if t.lag else ""  # noqa: E731
    parts = ["[" + ",".join(x.label(ap) for x in step.compute) + "]"]
    parts += [f"{t.slice.label(ap)}>{t.peer}{due(t)}" for t in step.sends]
    parts += [f"{t.slice.label(ap)}{'<=' if t.op == 'copy' else '<'}{t.peer}{due(t)}" for t in step.recvs]
    return " ".join(parts)


def grid(schedules: Sequence[Schedule]) -> str:
    """Rank x step grid of one schedule per rank."""
    n = max(len(s.steps) for s in schedules)
    ap = any(x.part for s in schedules for st in s.steps for x in st.compute)  # show .0 where parts exist
    rows = [["rank"] + [f"step {i}" for i in range(n)]]
    for s in schedules:
        rows.append([f"r{s.rank}"] + [_cell(i, st, ap) for i, st in enumerate(s.steps)] + [""] * (n - len(s.steps)))
    widths = [max(len(row[c]) for row in rows) for c in range(n + 1)]
    title = f"{schedules[0].name or schedules[0].kind}  P={len(schedules)}"
    lines = [title] + ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    return "\n".join(lines)
