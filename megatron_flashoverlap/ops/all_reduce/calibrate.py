"""The decode all-reduce's measurement on the real group: the chooser's measured tier (plan/chooser.py).

    decode_pick(chooser, decode_key(n, h, dtype, layout, members), dtype, device, group, ctx, g)
        -> the algorithm of a decode step's all-reduce of y [1, n, h] (n tokens, h the hidden size)
        key: all_reduce/decode/<bucket of n>; where no higher tier answers and the budget allows, stock and
        every candidate (`candidates`: the algorithms distinct on this layout) are timed in paired rounds
        (runtime/timing.py `paired`) on a message [1, bucket, h] of x's dtype, ONCE per bucket; group rank 0
        logs one line (plan/chooser.py `line`) and, under choices.write, rewrites the choice file
    startup_table(group, g, dtype, device, ctx) -> a calibration-table entry: the same rounds at every size of
        SIZES (the offline sweep of tools/calibrate_allreduce.py and benchmarks/topology)
Inside a CUDA-graph capture nothing is measured: the bucket takes the choice already made, else the model's.
"""
from __future__ import annotations

import logging
import statistics
import time

import torch
import torch.distributed as dist

from ...plan.chooser import DECODE_SITE, Chooser, Key, bucket, layout_word, line
from ...runtime.timing import paired
from ..registry import plain
from .select import dtype_name

log = logging.getLogger(__name__)
OP = "all_reduce"
SIZES = tuple(2048 << i for i in range(12))  # 2 KB - 4 MB: decode's [1, b, h] for b * h * bytes in this range
ROUNDS, WARMUP = 5, 1  # 5 paired rounds: a candidate must win 4 of them (plan/chooser.py PAIRED_WINS)


def candidates(world: int, local_world_size: int) -> tuple[str, ...]:
    """The reference and our algorithms distinct on this layout (hierarchical is the ring on one node and
    recursive doubling with one rank per node, so it is measured only where 1 < G < P; halving-doubling across
    nodes only where there are more than two: at two it is recursive doubling with one more step)."""
    two_level = 1 < local_world_size < world
    hd = ("hierarchical_hd",) if two_level and world // local_world_size > 2 else ()
    return ("reference", "ring", "recursive_doubling") + (("hierarchical", "hierarchical_pipelined") + hd
                                                          if two_level else ())


def capturing(device: torch.device) -> bool:
    """Inside a CUDA-graph capture (where nothing may be measured)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _samples(x, algos, group, ctx, g, rounds, warmup) -> dict[str, list[float]]:
    """{algo: [seconds per kept round]} of one call of each on `x`, the max over the group."""
    return paired({a: (lambda f=plain(OP, a): f(x, group, ctx, g)) for a in algos}, group, x.device,
                  rounds=rounds, warmup=warmup)


def group_layout(group, g: int | None, dtype: torch.dtype) -> tuple[str, tuple]:
    """(the layout word of `group` with g ranks per node and this dtype, the group's global ranks)."""
    layout = layout_word(dist.get_world_size(group), g, str(dist.get_backend(group)), dtype_name(dtype))
    return layout, tuple(dist.get_process_group_ranks(group) if group is not None else range(dist.get_world_size()))


def decode_key(tokens: int, h: int, dtype: torch.dtype, layout: str, members: tuple) -> Key:
    """all_reduce/decode/<bucket of tokens>: the key of a decode step's all-reduce of y [1, tokens, h]."""
    b = bucket(tokens)
    return Key(DECODE_SITE, "decode", b, layout, f"h {h}", members, b * h * torch.empty((), dtype=dtype).element_size())


def decode_pick(chooser: Chooser, key: Key, dtype: torch.dtype, device: torch.device, group, ctx, g: int) -> str:
    """The all-reduce algorithm for `key` (decode_key; module docstring). Collective under measurement: every
    rank of `group` reaches it in the same call, as the all-reduce itself."""
    known = chooser.answer(key)
    if known is not None:
        return known.pick
    if capturing(device):
        choice = chooser.fallback(key, "first seen inside a CUDA-graph capture, where nothing is measured")
    elif not chooser.can_measure():
        choice = chooser.fallback(key, f"choices.budget_s {chooser.budget_s:g} s spent")
    else:
        h = key.nbytes // (key.bucket * torch.empty((), dtype=dtype).element_size())
        probe = torch.ones((1, key.bucket, h), dtype=dtype, device=device)
        choice = chooser.decide(key, _samples(probe, candidates(dist.get_world_size(group), g), group, ctx, g,
                                              ROUNDS, WARMUP))
    announce(chooser, key, choice, group)
    return choice.pick


def announce(chooser: Chooser, key: Key, choice, group) -> None:
    """Group rank 0 logs the decision's one line; the job's rank 0 rewrites choices.write."""
    if dist.get_rank(group) == 0:
        log.warning(line(key, choice))
    path = chooser.config.choices.write if chooser.config is not None else None
    if path and dist.get_rank() == 0:
        import yaml

        with open(path, "w") as f:
            yaml.safe_dump(chooser.as_config(), f, sort_keys=False)


def _rows(times: torch.Tensor, algos, sizes) -> list[dict]:
    """times [size, algo, round] -> rows {"bytes", "<algo>_us" (median), "<algo>_min_us", "<algo>_rounds_us"}."""
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
    """Measure every candidate at every size on `group` (collective: every rank calls it alike) -> a table
    entry keyed by (world_size, local_world_size=g, backend, dtype). None: SIZES, ROUNDS, WARMUP."""
    if capturing(device):
        raise ValueError("all-reduce calibration inside a CUDA-graph capture; run it before capturing")
    sizes, rounds, warmup = sizes or SIZES, rounds or ROUNDS, WARMUP if warmup is None else warmup
    world = dist.get_world_size(group)
    algos = candidates(world, g)
    esize = torch.empty((), dtype=dtype).element_size()
    t0 = time.perf_counter()
    per_size = []
    for nbytes in sizes:
        x = torch.ones(max(nbytes // esize, 1), dtype=dtype, device=device)
        got = _samples(x, algos, group, ctx, g, rounds, warmup)
        per_size.append([got[a] for a in algos])
    times = torch.tensor(per_size, dtype=torch.float64)  # [size, algo, round] seconds, the max over ranks
    return {"world_size": world, "local_world_size": g, "backend": str(dist.get_backend(group)),
            "dtype": dtype_name(dtype), "iters": rounds, "source": "calibration",
            "seconds": round(time.perf_counter() - t0, 2), "rows": _rows(times, algos, sizes)}
