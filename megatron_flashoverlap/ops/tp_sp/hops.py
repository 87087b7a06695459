"""How many row sub-chunks one hop of the flash ring is cut in (`hop_chunks`, c), for the TP/SP operators.

A hop cut in c sub-chunks travels as c transfers, all posted ahead (schedules/ring.py): the GEMM slice of
sub-chunk j starts as soon as it arrived (all-gather), a sub-chunk's partial leaves as soon as it is made
(reduce-scatter). Where a hop takes longer than one GEMM slice (s/P rows), the block is link-bound and
what stays above max(compute, comm) is the slice that cannot overlap: the last arrived one (AG) / the
first made one (RS). Sub-chunks shrink it from C/P to C/(P c), for c - 1 more posts per hop.

    check_hop_chunks(op, algo, requested)   the caller's request: None (automatic) or an int >= 1, and
                                            only for algo "flash"; else a ValueError naming the fix
    hop_chunks_for(algo, requested, world, shard_rows, row_width) -> c   of the algorithm that runs (1 for
                                            any but "flash", e.g. under force_reference): None -> the
                                            automatic rule, an int capped at shard_rows (every sub-chunk
                                            keeps a row; the same cap on every rank: shapes agree)

Automatic rule (`_auto_hop_chunks`): c = 1 for P >= 3: P-1 hops run under P slices and the one slice left
over is C/P, small already (and the operator cannot tell a short hop from a long one: it does not know the
link). At P = 2 the one slice left over is half the GEMM, the largest it gets: c = AUTO_P2_CHUNKS, where
each sub-chunk keeps at least MIN_GEMM_ROWS GEMM rows (fewer rows run a slower small-M BLAS path).
"""
from __future__ import annotations

AUTO_P2_CHUNKS = 2
MIN_GEMM_ROWS = 64


def _auto_hop_chunks(world: int, shard_rows: int, row_width: int) -> int:
    """Sub-chunks per hop where the caller left it open (module docstring)."""
    if world != 2:
        return 1
    for c in range(AUTO_P2_CHUNKS, 1, -1):
        if (shard_rows // c) * row_width >= MIN_GEMM_ROWS:
            return c
    return 1


def check_hop_chunks(op: str, algo: str, requested) -> None:
    """ValueError unless `requested` is None, or an int >= 1 with algo 'flash' (module docstring)."""
    if requested is None:
        return
    if isinstance(requested, bool) or not isinstance(requested, int) or requested < 1:
        raise ValueError(f"{op}: hop_chunks must be an integer >= 1 (sub-chunks per hop) or None (automatic), "
                         f"got {requested!r}")
    if algo != "flash":
        raise ValueError(f"{op}: hop_chunks is a knob of algo 'flash' only (got algo {algo!r}); remove it or "
                         f"use algo='flash'")


def hop_chunks_for(algo: str, requested, world: int, shard_rows: int, row_width: int) -> int:
    """-> the sub-chunks per hop of the algorithm that runs (module docstring)."""
    if algo != "flash":
        return 1
    c = _auto_hop_chunks(world, shard_rows, row_width) if requested is None else requested
    return max(1, min(c, shard_rows))
