"""Start-up calibration of all_reduce(algo="auto"): a short measurement on the real group, made once per
(world_size, local_world_size, backend, dtype), the first time a decode-shaped tensor asks for "auto".

    table = startup_table(group, g, x.dtype, x.device, ctx)   -> a calibration-table entry (select.py)

What runs: messages of 2 KB - 4 MB (x2, SIZES), every candidate (the reference, and each of our algorithms
that differs from the others on this layout: `candidates`) `warmup + rounds` times per size, interleaved
(round r starts at candidate r mod n), the warm-up rounds dropped. A table file (all_reduce.table, its
environment variable, set_calibration) overrides it: then nothing is measured at start-up.

Timing, per device:
    cuda  a CUDA event pair around each call on the current stream; one synchronize per size, after all its
          rounds (none inside the op path: the operators stay stream-ordered); NCCL orders the ranks.
    cpu   the host clock around each call, after a barrier of the group.
Every rank decides the same: the per-call times are all-reduced (MAX) over the group, so all ranks hold the
same numbers and select.best_at picks the same algorithm per size (the slowest rank's time is the time of a
collective). Group rank 0 logs one line: the layout, the seconds spent, the choice per size range.
"""
from __future__ import annotations

import logging
import statistics
import time

import torch
import torch.distributed as dist

from ..registry import plain
from .select import dtype_name

log = logging.getLogger(__name__)
OP = "all_reduce"
SIZES = tuple(2048 << i for i in range(12))  # 2 KB - 4 MB: decode's [1, b, h] for b * h * bytes in this range
ROUNDS, WARMUP = 5, 1  # 5 paired rounds: select.best_at takes ours where it won 4 of them (PAIRED_WINS)


def candidates(world: int, local_world_size: int) -> tuple[str, ...]:
    """The reference and our algorithms distinct on this layout (hierarchical is the ring on one node and
    recursive doubling with one rank per node, so it is measured only where 1 < G < P; halving-doubling across
    nodes only where there are more than two: at two it is recursive doubling with one more step)."""
    two_level = 1 < local_world_size < world
    hd = ("hierarchical_hd",) if two_level and world // local_world_size > 2 else ()
    return ("reference", "ring", "recursive_doubling") + (("hierarchical", "hierarchical_pipelined") + hd
                                                          if two_level else ())


def _refuse_capture(device: torch.device) -> None:
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise ValueError("all_reduce(algo='auto'): the start-up calibration would run inside CUDA graph capture; run "
                         "one decode step eagerly before capturing (Megatron's inference warm-up does), or set a "
                         "table file (all_reduce.table), or pass decode_all_reduce='reference'")


def _samples(x, algos, group, ctx, g, rounds, warmup) -> list[list[float]]:
    """[algo][round] seconds of one call on this rank (cuda: events, synchronised once at the end)."""
    cuda = x.device.type == "cuda"
    got: list[list] = [[] for _ in algos]
    for r in range(warmup + rounds):
        for k in [(r + i) % len(algos) for i in range(len(algos))]:
            fn = plain(OP, algos[k])
            if cuda:
                ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                ev[0].record()
                fn(x, group, ctx, g)
                ev[1].record()
            else:
                dist.barrier(group)
                t0 = time.perf_counter()
                fn(x, group, ctx, g)
                ev = time.perf_counter() - t0
            if r >= warmup:
                got[k].append(ev)
    if cuda:
        torch.cuda.synchronize(x.device)
        got = [[a.elapsed_time(b) / 1e3 for a, b in row] for row in got]
    return got


def _rows(times: torch.Tensor, algos, sizes) -> list[dict]:
    """times [size, algo, round] (max over ranks) -> rows {"bytes", "<algo>_us" (median), "<algo>_min_us",
    "<algo>_rounds_us"}."""
    rows = []
    for s, nbytes in enumerate(sizes):
        row = {"bytes": int(nbytes)}
        for k, a in enumerate(algos):
            per_round = times[s, k].tolist()
            row[f"{a}_us"] = round(statistics.median(per_round) * 1e6, 1)
            row[f"{a}_min_us"] = round(min(per_round) * 1e6, 1)
            row[f"{a}_rounds_us"] = [round(t * 1e6, 1) for t in per_round]
        rows.append(row)
    return rows


def startup_table(group, g: int, dtype: torch.dtype, device: torch.device, ctx, *, sizes=None,
                  rounds: int | None = None, warmup: int | None = None) -> dict:
    """Measure every candidate at every size on `group` (collective: every rank calls it alike) -> the table
    entry select.py reads, keyed by (world_size, local_world_size=g, backend, dtype). None: SIZES, ROUNDS,
    WARMUP as they are at the call."""
    _refuse_capture(device)
    sizes, rounds, warmup = sizes or SIZES, rounds or ROUNDS, WARMUP if warmup is None else warmup
    world = dist.get_world_size(group)
    algos = candidates(world, g)
    esize = torch.empty((), dtype=dtype).element_size()
    t0 = time.perf_counter()
    per_size = []
    for nbytes in sizes:
        x = torch.ones(max(nbytes // esize, 1), dtype=dtype, device=device)
        per_size.append(_samples(x, algos, group, ctx, g, rounds, warmup))
    times = torch.tensor(per_size, dtype=torch.float64, device=device)  # [size, algo, round] seconds
    dist.all_reduce(times, op=dist.ReduceOp.MAX, group=group)           # the same numbers on every rank
    table = {"world_size": world, "local_world_size": g, "backend": str(dist.get_backend(group)),
             "dtype": dtype_name(dtype), "iters": rounds, "source": "start-up calibration",
             "seconds": round(time.perf_counter() - t0, 2), "rows": _rows(times.cpu(), algos, sizes)}
    return table
