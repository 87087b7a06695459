"""All-reduce on torch.distributed P2P: ring, flat recursive doubling, hierarchical; and the reference.

    tensor [*]  (any shape, every rank the same)  ->  out [*] = sum over the group's ranks, input unchanged

The message is flattened, zero-padded to a multiple of the schedule's block count (the zeros add nothing,
so any size works, down to one element) and walked by the one executor (runtime.pipeline.exchange).
Transfers and sums run in the input dtype, as stock all-reduce does (NCCL and gloo sum bf16 in bf16); only
the order of the sums differs from stock, so results agree within rounding, not bitwise.

All plain functions share one signature: (x, group, ctx, local_world_size) -> out, registered as
"all_reduce" in ops/registry.py. algo "auto": a decode-shaped tensor [1, b, h] takes the chooser's pick
(plan/chooser.py, the active config's; measured once per token bucket by choose.decode_pick, every rank
of the group reaching it in the same call, as the all-reduce is collective); any other shape runs stock.
Node layout: `local_world_size` = group ranks per node, ranks node-contiguous (rank = node * G + local,
as Megatron's tensor-parallel groups are); default derived from the group's global ranks and
LOCAL_WORLD_SIZE (`resolve_local_world_size`, select.node_layout).
"""
from __future__ import annotations

import dataclasses
import logging
import os

import torch
import torch.distributed as dist

from ...config import ALL_REDUCE_ALGOS, active
from ...plan.chooser import chooser_of
from ...schedules import ALL_REDUCE
from ...runtime import OverlapContext, default_context, exchange, global_rank, group_info, names_operator
from ..choose import group_layout
from .choose import decode_key, decode_pick
from .select import is_decode_shaped, node_layout, warn_once
from ..checks import peers_agree
from ..registry import plain, register, resolve_algo

log = logging.getLogger(__name__)
AR_ALGOS = ALL_REDUCE_ALGOS  # the public name of the all-reduce words
OP = "all_reduce"
_FLOATS = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def resolve_local_world_size(world: int, local_world_size: int | None, group=None, *,
                             strict: bool = True) -> int | None:
    """G, the group ranks per node. Explicit: checked to divide the group size. Else from the group's global
    ranks and LOCAL_WORLD_SIZE (the job's ranks per node; unset: one node, G = world) via `node_layout`;
    where that layout is not node-contiguous and balanced: ValueError naming why (strict, hierarchical),
    None (not strict: "auto" then runs stock)."""
    if local_world_size is not None:
        if local_world_size < 1 or world % local_world_size:
            raise ValueError(f"all_reduce: local_world_size {local_world_size} does not divide the group size "
                             f"{world}; pass local_world_size= the number of group ranks per node (equal on every "
                             f"node), or leave it unset to derive it from LOCAL_WORLD_SIZE")
        return local_world_size
    env = os.environ.get("LOCAL_WORLD_SIZE")  # torchrun's ranks per node (torchrun's variable, not ours)
    if not env:
        return world
    if not env.isdigit() or int(env) < 1:
        raise ValueError(f"LOCAL_WORLD_SIZE={env!r} is not a positive number of ranks per node; fix or unset it")
    layout = node_layout([global_rank(group, i) for i in range(world)], int(env))
    if layout.per_node is None and strict:
        raise ValueError(f"all_reduce(algo='hierarchical'): {layout.why_not()} (LOCAL_WORLD_SIZE={env}); use "
                         f"algo='ring', 'recursive_doubling' or 'auto', or pass local_world_size= explicitly")
    if layout.per_node is None:
        warn_once(("layout", layout.nodes), "all_reduce(algo='auto'): %s (LOCAL_WORLD_SIZE=%s); using stock "
                                            "all-reduce", layout.why_not(), env)
    return layout.per_node


@register(OP, "reference")
def all_reduce_reference(x, group, ctx, local_world_size=None):
    """Reference: torch.distributed.all_reduce on a copy."""
    out = x.clone()
    dist.all_reduce(out, group=group)
    return out


def _scheduled(word: str):
    """The plain function of an exchange word (schedules.ALL_REDUCE): its schedule on the executor; a two-level
    word gets the node layout (resolve_local_world_size)."""
    two_level = ALL_REDUCE[word].two_level

    def run(x, group, ctx, local_world_size=None):
        if not two_level:
            return exchange(x, word, group, ctx)
        g = resolve_local_world_size(group_info(group)[1], local_world_size, group)
        return exchange(x, word, group, ctx, local_world_size=g)
    run.__name__, run.__doc__ = f"all_reduce_{word}", ALL_REDUCE[word].summary
    return run


for _word in ALL_REDUCE:
    register(OP, _word)(_scheduled(_word))


@names_operator
class _AllReduce(torch.autograd.Function):
    """forward out = sum_r x_r;  backward dx = dout (identity: Megatron's reduce_from_tensor_model_parallel
    region contract, the output is replicated and every rank holds the same dout)."""

    @staticmethod
    def forward(ctx, x, group, algo, context, local_world_size):
        return plain(OP, algo)(x, group, context, local_world_size)

    @staticmethod
    def backward(ctx, dout):
        return dout, None, None, None, None


def auto_key(tensor, group, g: int):
    """The chooser's key of auto's decode-shaped `tensor` [tokens, .., h] on `group`, g ranks per node."""
    h = tensor.shape[-1]
    return decode_key(tensor.numel() // h, h, tensor.dtype, *group_layout(group, g, tensor.dtype))


def _auto(tensor, group, g: int | None, ctx) -> str:
    """The algo "auto" runs: the chooser's for a decode-shaped tensor (stock where the node layout gave no G),
    stock for every other shape (prefill and training)."""
    if g is None or not is_decode_shaped(tensor):
        return "reference"
    quiet = dataclasses.replace(ctx, trace=None)  # the same buffers; a measurement stays out of the trace
    return decode_pick(chooser_of(active()), auto_key(tensor, group, g), tensor.dtype, tensor.device, group, quiet, g)


def all_reduce(tensor: torch.Tensor, group=None, *, algo: str = "auto", local_world_size: int | None = None,
               context: OverlapContext | None = None) -> torch.Tensor:
    """Sum `tensor [*]` over `group`; returns a new tensor, the input is left unchanged.

    algo: "auto" (for decode-shaped inputs the chooser's pick, measured once per token bucket: plan/chooser.py,
    choose.py; the reference otherwise), "reference" (torch.distributed.all_reduce), or a word of
    schedules.ALL_REDUCE (ring, recursive_doubling, hierarchical, hierarchical_pipelined, hierarchical_hd).
    `force_reference()` makes every call the reference.
    """
    algo = resolve_algo(OP, algo)
    if tensor.dtype not in _FLOATS:
        raise ValueError(f"all_reduce: dtype {tensor.dtype} is not supported; use float32, bfloat16 or float16")
    rank, world = group_info(group)
    if world == 1:
        return tensor.clone()
    ctx = context or default_context()
    # the node layout matters to hierarchical and to the table lookup of auto only
    two_level = algo in ALL_REDUCE and ALL_REDUCE[algo].two_level
    g = resolve_local_world_size(world, local_world_size, group, strict=two_level) \
        if algo == "auto" or two_level else world
    if algo == "auto":
        algo = _auto(tensor, group, g, ctx)
    if algo != "reference":
        peers_agree("all_reduce", group, world, tensor.device, ctx, tensor.numel(), _FLOATS.index(tensor.dtype))
    return _AllReduce.apply(tensor, group, algo, ctx, g)
