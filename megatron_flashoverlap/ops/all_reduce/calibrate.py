"""The decode all-reduce's measurement on the real group: the chooser's measured tier (plan/chooser.py).

    decode_pick(chooser, decode_key(n, h, dtype, layout, members), dtype, device, group, ctx, g)
        -> the algorithm of a decode step's all-reduce of y [1, n, h] (n tokens, h the hidden size)
        key: all_reduce/decode/<bucket of n>; where no higher tier answers and the budget allows, stock and
        every candidate (`candidates`: the algorithms distinct on this layout) are timed in paired rounds
        (runtime/timing.py `paired`) on a message of bucket x h elements of the dtype, ONCE per bucket; group rank 0
        logs one line (plan/chooser.py `line`) and, under choices.write, rewrites the choice file
    settle(chooser, key, device, group, measure) -> the Choice of a key no higher tier answered: the model's
        inside a CUDA-graph capture or once the budget is spent, else the rule on `measure()`'s paired samples;
        announced (`announce`). The prefill / mixed sites (ops/tp_nosp/choose.py) settle the same way.
"""
from __future__ import annotations

import logging
from typing import Callable

import torch
import torch.distributed as dist

from ...plan.chooser import DECODE_SITE, Choice, Chooser, Key, bucket, layout_word, line
from ...runtime.timing import paired
from ..registry import plain
from .select import dtype_name

log = logging.getLogger(__name__)
OP = "all_reduce"
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
    return Key(DECODE_SITE, "decode", b, layout, f"h {h}", members, b * h * dtype.itemsize)


def decode_pick(chooser: Chooser, key: Key, dtype: torch.dtype, device: torch.device, group, ctx, g: int) -> str:
    """The all-reduce algorithm for `key` (decode_key; module docstring). Collective under measurement: every
    rank of `group` reaches it in the same call, as the all-reduce itself."""
    known = chooser.answer(key)
    if known is not None:
        return known.pick

    def measure():
        probe = torch.ones(key.nbytes // dtype.itemsize, dtype=dtype, device=device)  # the bucket's message
        return _samples(probe, candidates(dist.get_world_size(group), g), group, ctx, g, ROUNDS, WARMUP)
    return settle(chooser, key, device, group, measure).pick


def settle(chooser: Chooser, key: Key, device: torch.device, group,
           measure: Callable[[], dict[str, list[float]]]) -> Choice:
    """The choice of `key` where no higher tier answered (module docstring); collective like `measure`."""
    if capturing(device):
        choice = chooser.fallback(key, "first seen inside a CUDA-graph capture, where nothing is measured")
    elif not chooser.can_measure(key):
        choice = chooser.fallback(key, f"choices.budget_s {chooser.budget_s:g} s: {chooser.spent_s:.1f} s "
                                       f"measured, this bucket would take about {chooser.expected_s(key):.1f} s")
    else:
        choice = chooser.decide(key, measure())
    announce(chooser, key, choice, group)
    return choice


def announce(chooser: Chooser, key: Key, choice: Choice, group) -> None:
    """Group rank 0 logs the decision's one line; the job's rank 0 rewrites choices.write."""
    if dist.get_rank(group) == 0:
        log.warning(line(key, choice))
    path = chooser.config.choices.write
    if path and dist.get_rank() == 0:
        import yaml

        with open(path, "w") as f:
            yaml.safe_dump(chooser.as_config(), f, sort_keys=False)
