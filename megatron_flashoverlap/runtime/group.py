"""Group facts and the stock collectives the references and slicing baselines call."""
from __future__ import annotations

import torch
import torch.distributed as dist


_INFO: dict = {}
_MAX_INFO = 256  # groups remembered; past that the cache starts over (it only saves host time)


def group_info(group) -> tuple[int, int]:
    """(rank in group, group size); (0, 1) when torch.distributed is not initialized. Cached per group
    object (the default group by its object too, so a re-initialized world is a new entry)."""
    if not dist.is_available() or not dist.is_initialized():
        return 0, 1
    key = dist.group.WORLD if group is None else group
    info = _INFO.get(key)
    if info is None:
        if len(_INFO) >= _MAX_INFO:
            _INFO.clear()
        info = _INFO[key] = (dist.get_rank(group), dist.get_world_size(group))
    return info


def global_rank(group, group_rank: int) -> int:
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def all_gather_into(out: torch.Tensor, inp: torch.Tensor, group, async_op: bool = False):
    """Stock all-gather along dim 0 (the name moved in torch 2.13; both are the same collective)."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, inp, group=group, async_op=async_op)


def reduce_scatter_into(out: torch.Tensor, inp: torch.Tensor, group, async_op: bool = False):
    """Stock sum reduce-scatter along dim 0."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(out, inp, group=group, async_op=async_op)
