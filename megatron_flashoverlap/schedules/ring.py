"""Ring schedules for all-gather + GEMM and GEMM + reduce-scatter, rank-adaptive.

P = world_size, r = rank, next = (r+1) % P, prev = (r-1) % P. Block b is rank b's shard (AG) or the
output block that ends on rank b (RS). With `bidirectional`, every block is cut in two parts: part 0
travels clockwise (to next), part 1 counter-clockwise (to prev); each hop then carries half the bytes.

AG, step i (the slice computed at step i arrived at the end of step i-1; step 0 is the local shard):
    compute (r-i)            send (r-i) -> next       recv (r-i-1) <- prev      (no transfer at i = P-1)
RS, step i (the accumulator of block d starts on d+1 and ends on d; own block is computed last):
    compute (r-1-i)          send (r-i) -> next       recv (r-1-i) <- prev      (no transfer at i = 0)
"""
from __future__ import annotations

from .step import Schedule, Slice, Step, Transfer


def _check(rank: int, world_size: int) -> None:
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a group of size {world_size}")


def all_gather_ring(rank: int, world_size: int, *, bidirectional: bool = False, tag: int = 0) -> Schedule:
    """Flash-AG: local shard first, then one shard per hop; the last action is a GEMM, never a transfer."""
    _check(rank, world_size)
    r, p = rank, world_size
    steps = []
    for i in range(p):
        last = i == p - 1
        if not bidirectional:
            compute = (Slice((r - i) % p, 0, tag),)
            sends = () if last else (Transfer((r + 1) % p, Slice((r - i) % p, 0, tag)),)
            recvs = () if last else (Transfer((r - 1) % p, Slice((r - i - 1) % p, 0, tag)),)
        else:
            compute = (Slice((r - i) % p, 0, tag), Slice((r + i) % p, 1, tag))
            sends = () if last else (Transfer((r + 1) % p, Slice((r - i) % p, 0, tag)),
                                     Transfer((r - 1) % p, Slice((r + i) % p, 1, tag)))
            recvs = () if last else (Transfer((r - 1) % p, Slice((r - i - 1) % p, 0, tag)),
                                     Transfer((r + 1) % p, Slice((r + i + 1) % p, 1, tag)))
        steps.append(Step(sends, recvs, compute))
    parts = 2 if bidirectional else 1
    local = tuple(Slice(r, k, tag) for k in range(parts))
    expected = tuple(Slice(b, k, tag) for b in range(p) for k in range(parts))
    return Schedule("consume", r, p, tuple(steps), parts=parts, name="all_gather_ring", local=local,
                    expected=expected)


def reduce_scatter_ring(rank: int, world_size: int, *, bidirectional: bool = False, tag: int = 0) -> Schedule:
    """Flash-RS: produce the partial for the block the next hop carries; own block last, no tail."""
    _check(rank, world_size)
    r, p = rank, world_size
    steps = []
    for i in range(p):
        first = i == 0
        if not bidirectional:
            compute = (Slice((r - 1 - i) % p, 0, tag),)
            sends = () if first else (Transfer((r + 1) % p, Slice((r - i) % p, 0, tag)),)
            recvs = () if first else (Transfer((r - 1) % p, Slice((r - 1 - i) % p, 0, tag)),)
        else:
            compute = (Slice((r - 1 - i) % p, 0, tag), Slice((r + 1 + i) % p, 1, tag))
            sends = () if first else (Transfer((r + 1) % p, Slice((r - i) % p, 0, tag)),
                                      Transfer((r - 1) % p, Slice((r + i) % p, 1, tag)))
            recvs = () if first else (Transfer((r - 1) % p, Slice((r - 1 - i) % p, 0, tag)),
                                      Transfer((r + 1) % p, Slice((r + 1 + i) % p, 1, tag)))
        steps.append(Step(sends, recvs, compute))
    parts = 2 if bidirectional else 1
    expected = tuple(Slice(b, k, tag) for b in range(p) for k in range(parts))
    final = tuple(Slice(r, k, tag) for k in range(parts))
    return Schedule("produce", r, p, tuple(steps), parts=parts, accumulate=True, name="reduce_scatter_ring",
                    expected=expected, final=final)
