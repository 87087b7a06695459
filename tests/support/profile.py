"""Test helpers that profile a callable: which c10d operations and which of our autograd Functions ran.

    comm_ops(fn)        {kind: count} of the collectives and P2P ops fn() issued
    autograd_fns(fn)    {name: forward calls} of our autograd Functions
"""
from __future__ import annotations

import torch


def comm_ops(fn) -> dict:
    """Run fn() under torch.profiler; -> {kind: count} of the c10d ops it issued, kind in
    all_gather / reduce_scatter / all_reduce / all_to_all / send / recv (the dispatcher op names `c10d::...`)."""
    from collections import Counter

    kinds = {"allgather": "all_gather", "reduce_scatter": "reduce_scatter", "allreduce": "all_reduce",
             "alltoall": "all_to_all", "send": "send", "recv": "recv"}
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    counts: Counter = Counter()
    for e in prof.events():
        if e.name.startswith("c10d::"):
            counts.update(v for k, v in kinds.items() if k in e.name)
    return dict(counts)


def autograd_fns(fn, names=("AllGatherMatmul", "MatmulReduceScatter")) -> dict:
    """Run fn() under torch.profiler; -> {name: forward calls} of our autograd Functions."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {n: sum(1 for e in prof.events() if e.name == n) for n in names}
