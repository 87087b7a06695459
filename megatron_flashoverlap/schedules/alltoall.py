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


def expert_pipeline(rank: int, world_size: int, *, ins: int = 2, outs: int = 1) -> Schedule:
    """The fused MoE exchange (kind "pipeline"): dispatch, the local experts and combine in one walk.

    Tags 0..ins-1: the tensors a block brings (tokens, probs); ins..ins+outs-1: the tensors it returns.
    Slice(src, dst, t) is tensor t of src's tokens routed to dst (or of their expert output). The compute
    Slice(src, r, ins) runs the experts on src's block; the own block is split in two halves,
    Slice(r, r, ins) first and Slice(r, r, ins+outs) last, so the first dispatch hop and the last
    combine hop both have compute under them. Steps j = 0..P:
        dispatch  send r -> r+j+1, recv r-j-1 <- (j <= P-2)
        combine   send out of block r-j+1 -> r-j+1, recv r+j-1 -> (2 <= j <= P)
        compute   j = 0: own half A; 1 <= j <= P-1: block r-j (arrived at step j-1); j = P: own half B
    """
    _check(rank, world_size)
    r, p = rank, world_size
    tin, tout, half_b = range(ins), range(ins, ins + outs), ins + outs
    steps = []
    for j in range(p + 1):
        sends, recvs = [], []
        if j <= p - 2:
            d, s = (r + j + 1) % p, (r - j - 1) % p
            sends += [Transfer(d, Slice(r, d, t)) for t in tin]
            recvs += [Transfer(s, Slice(s, r, t)) for t in tin]
        if j >= 2:
            s, e = (r - j + 1) % p, (r + j - 1) % p
            sends += [Transfer(s, Slice(s, r, t)) for t in tout]
            recvs += [Transfer(e, Slice(r, e, t)) for t in tout]
        compute = Slice(r, r, half_b) if j == p else Slice((r - j) % p, r, ins)
        steps.append(Step(tuple(sends), tuple(recvs), (compute,)))
    local = tuple(Slice(r, d, t) for d in range(p) for t in tin)
    expected = tuple(Slice(s, r, ins) for s in range(p)) + (Slice(r, r, half_b),)
    return Schedule("pipeline", r, p, tuple(steps), name="expert_pipeline", local=local, expected=expected)
