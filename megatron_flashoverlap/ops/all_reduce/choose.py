"""The decode all-reduce's measurement on the real group: the chooser's measured tier (plan/chooser.py).

    decode_pick(chooser, decode_key(n, h, dtype, layout, members), dtype, device, group, ctx, g)
        -> the algorithm of a decode step's all-reduce of y [1, n, h] (n tokens, h the hidden size)
        key: all_reduce/decode/<bucket of n>; where no higher tier answers and the budget allows, stock and
        every candidate (`candidates`: the algorithms distinct on this layout) are timed in paired rounds
        (runtime/timing.py `paired`) on a message of bucket x h elements of the dtype, ONCE per bucket; group rank 0
        logs one line and, under choices.write, rewrites the choice file (ops/choose.py `settle`)
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ...plan.chooser import DECODE_SITE, Chooser, Key, Measured, bucket
from ...runtime.timing import paired
from ...schedules import ALL_REDUCE
from ..choose import ROUNDS, WARMUP, settle
from ..registry import plain

OP = "all_reduce"


def candidates(world: int, local_world_size: int) -> tuple[str, ...]:
    """The reference and the words distinct on this layout (schedules.ALL_REDUCE `distinct`: e.g. hierarchical is
    the ring on one node and recursive doubling with one rank per node, so it is measured only where 1 < G < P)."""
    return ("reference",) + tuple(w for w, word in ALL_REDUCE.items() if word.distinct(world, local_world_size))


def _samples(x, algos, group, ctx, g, rounds, warmup) -> dict[str, list[float]]:
    """{algo: [seconds per kept round]} of one call of each on `x`, the max over the group."""
    return paired({a: (lambda f=plain(OP, a): f(x, group, ctx, g)) for a in algos}, group, x.device,
                  rounds=rounds, warmup=warmup)


def decode_key(tokens: int, h: int, dtype: torch.dtype, layout: str, members: tuple) -> Key:
    """all_reduce/decode/<bucket of tokens>: the key of a decode step's all-reduce of y [1, tokens, h]."""
    b = bucket(tokens)
    return Key(DECODE_SITE, "decode", b, layout, f"h {h}", members, b * h * dtype.itemsize)


def decode_pick(chooser: Chooser, key: Key, dtype: torch.dtype, device: torch.device, group, ctx, g: int) -> str:
    """The all-reduce algorithm for `key` (decode_key; module docstring). Collective under measurement: every
    rank of `group` reaches it in the same call, as the all-reduce itself."""
    known = chooser.answer(key)
    if known is not None:
        return known.pick

    def measure():
        probe = torch.ones(key.nbytes // dtype.itemsize, dtype=dtype, device=device)  # the bucket's message
        return Measured.of(_samples(probe, candidates(dist.get_world_size(group), g), group, ctx, g, ROUNDS, WARMUP))
    return settle(chooser, key, device, group, measure).pick

