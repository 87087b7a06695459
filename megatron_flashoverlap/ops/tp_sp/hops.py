"""How many row sub-chunks one hop of the flash ring is cut in (`hop_chunks`, c), for the TP/SP operators.

A hop cut in c sub-chunks travels as c transfers, all posted ahead (schedules/ring.py): the GEMM slice of
sub-chunk j starts as soon as it arrived (all-gather), a sub-chunk's partial leaves as soon as it is made
(reduce-scatter). Where a hop takes longer than one GEMM slice (s/P rows), the block is link-bound and
what stays above max(compute, comm) is the slice that cannot overlap: the last arrived one (AG) / the
first made one (RS). Sub-chunks shrink it from C/P to C/(P c), for c - 1 more posts per hop.

    The request is OpPlan.hop_chunks: None (automatic) or an int >= 1, and only for algo "flash" (checked
    when the plan is made, ops/registry.py).
    hop_chunks_for(algo, requested, world, shard_rows, row_width) -> c   of the algorithm that runs (1 for
                                            any but "flash", e.g. under force_reference): None -> the
                                            automatic rule, an int capped at shard_rows (every sub-chunk
                                            keeps a row; the same cap on every rank: shapes agree)
    sized(plan, world, shard_rows, row_width) -> the plan with that c (flash; others unchanged), cached

Automatic rule (`_auto_hop_chunks`): c = 1 for P >= 3: P-1 hops run under P slices and the one slice left
over is C/P, small already. At P = 2 the slice left over is half the GEMM, the largest it gets, and c > 1
pays only where a hop takes longer than that slice, which the operator cannot see (it does not know the
link). Measured (benchmarks/overlap/RESULTS.md, "Hop sub-chunks"; gloo over a tbf-shaped loopback, 2 ranks on 2
shared CPUs): c = 2 won only where the hop was ~4x the slice (1 gbit/s, s = 1024, h = 256: 1.07x fwd), tied at
250 mbit/s and 2 gbit/s and at the issue's point (S = 2048, h = 1024, n = 8192: 0.97x), and lost up to 0.61x
on blocks of a few ms (4 gbit/s: each sub-chunk is one more post and wait through the communication thread,
~1-3 ms under load). So automatic is AUTO_P2_CHUNKS = 1 at P = 2 too; a layer whose hop is long against
its slice sets `hop_chunks: 2` in its plan. With AUTO_P2_CHUNKS > 1, each sub-chunk keeps at least
MIN_GEMM_ROWS GEMM rows (fewer rows run a slower small-M BLAS path).
"""
from __future__ import annotations

import functools
from dataclasses import replace

from ..registry import OpPlan

AUTO_P2_CHUNKS = 1  # measured basis in the module docstring
MIN_GEMM_ROWS = 64


def _auto_hop_chunks(world: int, shard_rows: int, row_width: int, p2_chunks: int = AUTO_P2_CHUNKS) -> int:
    """Sub-chunks per hop where the caller left it open (module docstring)."""
    if world != 2:
        return 1
    for c in range(p2_chunks, 1, -1):
        if (shard_rows // c) * row_width >= MIN_GEMM_ROWS:
            return c
    return 1


def hop_chunks_for(algo: str, requested, world: int, shard_rows: int, row_width: int) -> int:
    """-> the sub-chunks per hop of the algorithm that runs (module docstring)."""
    if algo != "flash":
        return 1
    c = _auto_hop_chunks(world, shard_rows, row_width) if requested is None else requested
    return max(1, min(c, shard_rows))


@functools.lru_cache(maxsize=1024)
def sized(plan: OpPlan, world: int, shard_rows: int, row_width: int) -> OpPlan:
    """`plan` with hop_chunks fixed for this group size and shard (flash); any other algo as it is."""
    if plan.algo != "flash":
        return plan
    c = hop_chunks_for(plan.algo, plan.hop_chunks, world, shard_rows, row_width)
    return plan if c == plan.hop_chunks else replace(plan, hop_chunks=c)
