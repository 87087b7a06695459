"""Ring schedules for all-gather + GEMM and GEMM + reduce-scatter, rank-adaptive.

P = world_size, r = rank, next = (r+1) % P, prev = (r-1) % P. Block b is rank b's shard (AG) or the
output block that ends on rank b (RS). With `bidirectional`, every block is cut in two parts: part 0
travels clockwise (to next), part 1 counter-clockwise (to prev); each hop then carries half the bytes.

AG, step i (the slice computed at step i arrived at the end of step i-1; step 0 is the local shard):
    compute (r-i)            send (r-i) -> next       recv (r-i-1) <- prev      (no transfer at i = P-1)
RS, step i (the accumulator of block d starts on d+1 and ends on d; own block is computed last):
    compute (r-1-i)          send (r-i) -> next       recv (r-1-i) <- prev      (no transfer at i = 0)

Hop sub-chunks (`chunks` = c > 1, one-directional ring): block b is cut in c row sub-chunks, slice (b, j)
is sub-chunk j, and every sub-chunk travels as its own transfer, so a GEMM slice of one sub-chunk starts
as soon as that sub-chunk is there (AG) and a sub-chunk's partial leaves as soon as it is made (RS):
    AG: step 0 computes the local shard (all c sub-chunks) and posts the c sub-chunks of the first hop at
        once (sub-chunk j waited at the end of step j: `lag` j); afterwards one step per arrived sub-chunk,
        each forwarded as it arrives (lag c-1: waited just before the receiver's slice of it).
    RS: one step per sub-chunk partial of the P-1 foreign blocks, each sent the step after it was made
        (lag c-1: added by the receiver right after it makes its own partial of it); the own block last
        (all c sub-chunks in one step), its c arrivals waited after it.
    P=2, c=2, AG rank 0 (a sub-chunk label is block.sub-chunk, `@s`: waited at the end of step s):
        step 0  [0.0,0.1] 0.0>1 1.0<1 0.1>1@1 1.1<1@1     step 1  [1.0]     step 2  [1.1]
c = 1 is the ring above, transfer for transfer (every lag 0).

Tail (`ring_tail`, compute only): pieces 0..n-1 of a computation spread over the P-1 hop steps of a ring it is
merged with, piece i in step i mod (P-1) (e.g. the column backward's wgrad under the all-reduce's last AG).
"""
from __future__ import annotations

from .step import Schedule, Slice, Step, Transfer


def _check(rank: int, world_size: int, chunks: int = 1, bidirectional: bool = False) -> None:
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a group of size {world_size}")
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks (sub-chunks per hop) must be an integer >= 1, got {chunks!r}")
    if bidirectional and chunks > 1:
        raise ValueError("hop sub-chunks (chunks > 1) are for the one-directional ring; use chunks=1 with "
                         "bidirectional=True, or bidirectional=False")


def _empty(n: int) -> list[list[list]]:
    return [[[], [], []] for _ in range(n)]  # per step: sends, recvs, compute


def _steps(cells: list[list[list]]) -> tuple[Step, ...]:
    return tuple(Step(tuple(s), tuple(r), tuple(c)) for s, r, c in cells)


def all_gather_ring(rank: int, world_size: int, *, bidirectional: bool = False, chunks: int = 1,
                    tag: int = 0) -> Schedule:
    """Flash-AG: local shard first, then one shard (or sub-chunk) per step; the last action is a GEMM."""
    _check(rank, world_size, chunks, bidirectional)
    if bidirectional:
        return _all_gather_bidir(rank, world_size, tag)
    r, p, c = rank, world_size, chunks
    at = lambda i, j: 0 if i == 0 else 1 + (i - 1) * c + j  # noqa: E731  step computing (r-i, j)
    cells = _empty(1 + (p - 1) * c)
    for i in range(p):
        for j in range(c):
            cells[at(i, j)][2].append(Slice((r - i) % p, j, tag))
            if i < p - 1:  # forward (r-i, j) where it is held; the receiver waits just before its slice
                lag = i * c + j - at(i, j)
                cells[at(i, j)][0].append(Transfer((r + 1) % p, Slice((r - i) % p, j, tag), lag=lag))
                cells[at(i, j)][1].append(Transfer((r - 1) % p, Slice((r - i - 1) % p, j, tag), lag=lag))
    local = tuple(Slice(r, j, tag) for j in range(c))
    expected = tuple(Slice(b, j, tag) for b in range(p) for j in range(c))
    return Schedule("consume", r, p, _steps(cells), parts=c, name="all_gather_ring", local=local,
                    expected=expected)


def _all_gather_bidir(r: int, p: int, tag: int) -> Schedule:
    steps = []
    for i in range(p):
        last = i == p - 1
        compute = (Slice((r - i) % p, 0, tag), Slice((r + i) % p, 1, tag))
        sends = () if last else (Transfer((r + 1) % p, Slice((r - i) % p, 0, tag)),
                                 Transfer((r - 1) % p, Slice((r + i) % p, 1, tag)))
        recvs = () if last else (Transfer((r - 1) % p, Slice((r - i - 1) % p, 0, tag)),
                                 Transfer((r + 1) % p, Slice((r + i + 1) % p, 1, tag)))
        steps.append(Step(sends, recvs, compute))
    local = (Slice(r, 0, tag), Slice(r, 1, tag))
    expected = tuple(Slice(b, k, tag) for b in range(p) for k in range(2))
    return Schedule("consume", r, p, tuple(steps), parts=2, name="all_gather_ring", local=local,
                    expected=expected)


def reduce_scatter_ring(rank: int, world_size: int, *, bidirectional: bool = False, chunks: int = 1,
                        tag: int = 0) -> Schedule:
    """Flash-RS: produce the partial for the block (sub-chunk) the next hop carries; own block last, no tail."""
    _check(rank, world_size, chunks, bidirectional)
    if bidirectional:
        return _reduce_scatter_bidir(rank, world_size, tag)
    r, p, c = rank, world_size, chunks
    at = lambda i, j: (p - 1) * c if i == p - 1 else i * c + j  # noqa: E731  step making (r-1-i, j)
    cells = _empty(1 + (p - 1) * c)
    for i in range(p):
        for j in range(c):
            cells[at(i, j)][2].append(Slice((r - 1 - i) % p, j, tag))
            if i < p - 1:  # sent the step after it is made; the receiver adds it right after making its own
                post = at(i, j) + 1
                lag = at(i + 1, j) - post
                cells[post][0].append(Transfer((r + 1) % p, Slice((r - 1 - i) % p, j, tag), lag=lag))
                cells[post][1].append(Transfer((r - 1) % p, Slice((r - 2 - i) % p, j, tag), lag=lag))
    expected = tuple(Slice(b, j, tag) for b in range(p) for j in range(c))
    final = tuple(Slice(r, j, tag) for j in range(c))
    return Schedule("produce", r, p, _steps(cells), parts=c, accumulate=True, name="reduce_scatter_ring",
                    expected=expected, final=final)


def _reduce_scatter_bidir(r: int, p: int, tag: int) -> Schedule:
    steps = []
    for i in range(p):
        first = i == 0
        compute = (Slice((r - 1 - i) % p, 0, tag), Slice((r + 1 + i) % p, 1, tag))
        sends = () if first else (Transfer((r + 1) % p, Slice((r - i) % p, 0, tag)),
                                  Transfer((r - 1) % p, Slice((r + i) % p, 1, tag)))
        recvs = () if first else (Transfer((r - 1) % p, Slice((r - 1 - i) % p, 0, tag)),
                                  Transfer((r + 1) % p, Slice((r + 1 + i) % p, 1, tag)))
        steps.append(Step(sends, recvs, compute))
    expected = tuple(Slice(b, k, tag) for b in range(p) for k in range(2))
    final = (Slice(r, 0, tag), Slice(r, 1, tag))
    return Schedule("produce", r, p, tuple(steps), parts=2, accumulate=True, name="reduce_scatter_ring",
                    expected=expected, final=final)


def ring_tail(rank: int, world_size: int, *, pieces: int, tag: int) -> Schedule:
    """Compute-only steps: piece i in step i mod (P-1) (module docstring)."""
    hops = max(world_size - 1, 1)
    steps = tuple(Step(compute=tuple(Slice(i, 0, tag) for i in range(pieces) if i % hops == s)) for s in range(hops))
    return Schedule("produce", rank, world_size, steps, name="tail")
