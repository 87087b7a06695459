"""All-reduce on torch.distributed P2P: ring, flat recursive doubling, hierarchical; and the stock one.

    tensor [*]  (any shape, every rank the same)  ->  out [*] = sum over the group's ranks, input unchanged

The message is flattened, zero-padded to a multiple of the schedule's block count (the zeros add nothing,
so any size works, down to one element) and walked by the one executor with `ExchangePass` as handler.
Transfers and sums run in the input dtype, as stock all-reduce does (NCCL and gloo sum bf16 in bf16); only
the order of the sums differs from stock, so results agree within rounding, not bitwise.

All plain functions share one signature: (x, group, ctx, local_world_size) -> out.
Node layout: `local_world_size` = group ranks per node, ranks node-contiguous (rank = node * G + local,
as Megatron's tensor-parallel groups are); default derived from the group's global ranks and
LOCAL_WORLD_SIZE (`resolve_local_world_size`, select.node_layout).
"""
from __future__ import annotations

import functools
import os

import torch
import torch.distributed as dist

from ...runtime import OverlapContext, default_context, execute, global_rank, group_info
from ...schedules import ALL_REDUCE_ALGOS, Slice, Transfer, all_reduce_schedule
from .select import choose, node_layout, warn_once
from ..checks import check_peers_agree

AR_ALGOS = ("auto", "stock") + ALL_REDUCE_ALGOS
_FLOATS = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


class ExchangePass:
    """Handler of an "exchange" schedule: `flat [blocks * size]` cut in equal blocks; arrivals add or copy."""

    def __init__(self, flat: torch.Tensor, blocks: int, ctx: OverlapContext, name: str = "ar", tag: int = 0):
        self.flat, self.size, self.ctx, self.name, self.tag = flat, flat.numel() // blocks, ctx, name, tag

    def view(self, x: Slice) -> torch.Tensor:
        return self.flat[x.block * self.size:(x.block + 1) * self.size]

    def send(self, x: Slice) -> torch.Tensor:
        return self.view(x)

    def recv(self, x: Slice) -> torch.Tensor:  # one scratch per block: a step receives a block at most once
        return self.ctx.buffer(f"{self.name}.recv.{x.block}", (self.size,), self.flat.dtype, self.flat.device)

    def compute(self, x: Slice) -> None:
        pass

    def arrived(self, t: Transfer) -> None:
        got = self.recv(t.slice)
        self.view(t.slice).copy_(got) if t.op == "copy" else self.view(t.slice).add_(got)


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
    env = os.environ.get("LOCAL_WORLD_SIZE")  # torchrun's ranks per node (not a FLASHOVERLAP_ variable)
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


def all_reduce_stock(x, group, ctx, local_world_size=None):
    """Reference: torch.distributed.all_reduce on a copy."""
    out = x.clone()
    dist.all_reduce(out, group=group)
    return out


_schedule = functools.lru_cache(maxsize=256)(all_reduce_schedule)  # pure data: build once per layout


def _run(algo: str, x, group, ctx, local_world_size):
    rank, world = group_info(group)
    sched = _schedule(algo, rank, world, local_world_size)
    blocks = len(sched.final)
    n = x.numel()
    flat = torch.empty(-(-n // blocks) * blocks, dtype=x.dtype, device=x.device)  # [blocks * size]
    flat[:n].copy_(x.reshape(-1))
    flat[n:].zero_()  # padding adds nothing
    execute(sched.steps, group, {0: ExchangePass(flat, blocks, ctx)}, ctx)
    return flat[:n].view(x.shape)


def all_reduce_ring(x, group, ctx, local_world_size=None):
    """RS + AG over P blocks: 2(P-1) steps of n/P."""
    return _run("ring", x, group, ctx, None)


def all_reduce_recursive_doubling(x, group, ctx, local_world_size=None):
    """log2(P') whole-message exchanges (+2 to fold a non-power-of-two P)."""
    return _run("recursive_doubling", x, group, ctx, None)


def all_reduce_hierarchical(x, group, ctx, local_world_size=None):
    """Intra-node RS, inter-node recursive doubling on n/G, intra-node AG."""
    g = resolve_local_world_size(group_info(group)[1], local_world_size, group)
    return _run("hierarchical", x, group, ctx, g)


PLAIN = {"stock": all_reduce_stock, "ring": all_reduce_ring, "recursive_doubling": all_reduce_recursive_doubling,
         "hierarchical": all_reduce_hierarchical}


class _AllReduce(torch.autograd.Function):
    """forward out = sum_r x_r;  backward dx = dout (identity: Megatron's reduce_from_tensor_model_parallel
    region contract, the output is replicated and every rank holds the same dout)."""

    @staticmethod
    def forward(ctx, x, group, algo, context, local_world_size):
        return PLAIN[algo](x, group, context, local_world_size)

    @staticmethod
    def backward(ctx, dout):
        return dout, None, None, None, None


def _check(x: torch.Tensor, algo: str) -> None:
    if algo not in AR_ALGOS:
        raise ValueError(f"all_reduce: unknown algo {algo!r}; choose one of {AR_ALGOS}")
    if x.dtype not in _FLOATS:
        raise ValueError(f"all_reduce: dtype {x.dtype} is not supported; use float32, bfloat16 or float16")


def all_reduce(tensor: torch.Tensor, group=None, *, algo: str = "auto", local_world_size: int | None = None,
               context: OverlapContext | None = None) -> torch.Tensor:
    """Sum `tensor [*]` over `group`; returns a new tensor, the input is left unchanged.

    algo: "auto" (ours only for decode-shaped inputs inside the calibrated window, stock otherwise: see
    ops/all_reduce_select.py), "stock", "ring", "recursive_doubling", "hierarchical".
    """
    _check(tensor, algo)
    rank, world = group_info(group)
    if world == 1:
        return tensor.clone()
    ctx = context or default_context()
    # the node layout matters to hierarchical and to the table lookup of auto only
    g = resolve_local_world_size(world, local_world_size, group, strict=algo == "hierarchical") \
        if algo in ("auto", "hierarchical") else world
    if algo == "auto":
        algo = choose(tensor, world, g, dist.get_backend(group))
    if ctx.check_peers and algo != "stock":
        check_peers_agree("all_reduce", group, world, tensor.device, tensor.numel(), _FLOATS.index(tensor.dtype))
    return _AllReduce.apply(tensor, group, algo, ctx, g)

