"""The chooser's measured tier, the steps every site shares (plan/chooser.py holds the precedence and the rule).

    group_layout(group, g, dtype) -> (layout word, the group's global ranks): what a choice key holds it for
    settle(chooser, key, device, group, measure) -> the Choice of a key no higher tier answered:
        the model's inside a CUDA-graph capture or once choices.budget_s is spent, else the rule on
        `measure()`'s Measured (plan/chooser.py: paired samples, runtime/timing.py `paired`, ROUNDS kept rounds
        after WARMUP, and the seconds charged); announced
    announce(chooser, key, choice, group): group rank 0 logs the one line (with the budget spent so far); the
        job's rank 0 rewrites choices.write
The sites' own measurements: the decode all-reduce (all_reduce/choose.py), the prefill / mixed row all-reduce
(tp_nosp/choose.py), the MoE exchange (moe/choose.py), Ulysses' all-to-all (attention/choose.py), a TP layer's
training step (megatron/train_choice.py). Collective: every rank of the group settles a key in the same call.
"""
from __future__ import annotations

import logging
from typing import Callable

import torch
import torch.distributed as dist

from ..plan.chooser import Choice, Chooser, Key, Measured, layout_word, line
from .all_reduce.select import dtype_name

log = logging.getLogger(__name__)
ROUNDS, WARMUP = 5, 1  # 5 paired rounds: a candidate must win 4 of them (plan/chooser.py PAIRED_WINS)


def capturing(device: torch.device) -> bool:
    """Inside a CUDA-graph capture (where nothing may be measured)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def group_layout(group, g: int | None, dtype: torch.dtype) -> tuple[str, tuple]:
    """(the layout word of `group` with g ranks per node and this dtype, the group's global ranks)."""
    layout = layout_word(dist.get_world_size(group), g, str(dist.get_backend(group)), dtype_name(dtype))
    return layout, tuple(dist.get_process_group_ranks(group) if group is not None else range(dist.get_world_size()))


def settle(chooser: Chooser, key: Key, device: torch.device, group,
           measure: Callable[[], Measured]) -> Choice:
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
        log.warning("%s (%.1f of choices.budget_s %g s measured so far)", line(key, choice), chooser.spent_s,
                    chooser.budget_s)
    path = chooser.config.choices.write
    if path and dist.get_rank() == 0:
        import yaml

        with open(path, "w") as f:
            yaml.safe_dump(chooser.as_config(), f, sort_keys=False)
