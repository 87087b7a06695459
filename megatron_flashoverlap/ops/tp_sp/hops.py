"""How many row sub-chunks one hop of the flash ring is cut in (`hop_chunks`, c), for the TP/SP operators.

    hop [rows/P, k] -> c transfers of [rows/(P c), k], all posted ahead (schedules/ring.py)

    hop_chunks_for(algo, requested, shard_rows) -> c    the algorithm that runs: "flash" takes the request
                                                        (None: 1), capped at shard_rows so every sub-chunk
                                                        keeps a row (the same cap on every rank); any other
                                                        algorithm, e.g. under force_reference: 1
    sized(plan, shard_rows) -> the plan with that c (flash; any other plan unchanged), cached

A sub-chunk's GEMM slice starts as soon as it arrives (all-gather), its partial leaves as soon as it is made
(reduce-scatter), so c shrinks the one slice a link-bound block cannot overlap from C/P to C/(P c), for c - 1
more posts and waits per hop. The operator cannot see whether a hop outlasts its slice (it does not know the
link), and each extra post costs host time, so an open request is one transfer per hop; a layer whose hop is
long against its slice sets `hop_chunks` in its plan, and the planner fills it where the YAML leaves it open
(plan/probe_plan.py). The measured basis: benchmarks/overlap/RESULTS.md, "Hop sub-chunks at P = 2".
"""
from __future__ import annotations

import functools
from dataclasses import replace

from ..registry import OpPlan


def hop_chunks_for(algo: str, requested, shard_rows: int) -> int:
    """-> the sub-chunks per hop of the algorithm that runs (module docstring)."""
    if algo != "flash":
        return 1
    return max(1, min(requested or 1, shard_rows))


@functools.lru_cache(maxsize=1024)
def sized(plan: OpPlan, shard_rows: int) -> OpPlan:
    """`plan` with hop_chunks fixed for this shard (flash); any other algo as it is."""
    if plan.algo != "flash":
        return plan
    c = hop_chunks_for(plan.algo, plan.hop_chunks, shard_rows)
    return plan if c == plan.hop_chunks else replace(plan, hop_chunks=c)
