"""Pairwise all-to-all schedules (Ulysses). Slice(block=src, part=dst) is src's piece for dst.

Step s exchanges with peer (r+s) (send) and (r-s) (recv), s = 1..P-1.
- `all_to_all_produce`: before attention. Step s computes the piece for the peer of step s+1 while the
  piece of step s flies; the own piece (r -> r) is computed last and never sent.
- `all_to_all_consume`: after attention. The own piece is consumed at step 0; the piece that arrived in
  step s is consumed at step s+1, while the next one flies.
"""
from __future__ import annotations

from .ring import _check
from .step import Schedule, Slice, Step, Transfer


def all_to_all_produce(rank: int, world_size: int, *, tag: int = 0) -> Schedule:
    _check(rank, world_size)
    r, p = rank, world_size
    steps = []
    for s in range(p):
        compute = (Slice(r, (r + s + 1) % p, tag),)
        sends = () if s == 0 else (Transfer((r + s) % p, Slice(r, (r + s) % p, tag)),)
        recvs = () if s == 0 else (Transfer((r - s) % p, Slice((r - s) % p, r, tag)),)
        steps.append(Step(sends, recvs, compute))
    expected = tuple(Slice(r, d, tag) for d in range(p))
    return Schedule("produce", r, p, tuple(steps), name="all_to_all_produce", expected=expected)


def all_to_all_consume(rank: int, world_size: int, *, tag: int = 0) -> Schedule:
    _check(rank, world_size)
    r, p = rank, world_size
    steps = []
    for s in range(p):
        compute = (Slice((r - s) % p, r, tag),)
        last = s == p - 1
        sends = () if last else (Transfer((r + s + 1) % p, Slice(r, (r + s + 1) % p, tag)),)
        recvs = () if last else (Transfer((r - s - 1) % p, Slice((r - s - 1) % p, r, tag)),)
        steps.append(Step(sends, recvs, compute))
    local = tuple(Slice(r, d, tag) for d in range(p))
    expected = tuple(Slice(src, r, tag) for src in range(p))
    return Schedule("consume", r, p, tuple(steps), name="all_to_all_consume", local=local, expected=expected)
