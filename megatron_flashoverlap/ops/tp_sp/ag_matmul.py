"""All-gather + GEMM (column-parallel under sequence parallel), and its backward.

    x_shard_s [s/P, b, h]    weight_n [n/P, h]    bias_n [n/P]    y [s, b, n/P]

    forward  y = AG(x) @ w^T + bias
    dgrad    dx = RS(dy @ w)            (the dual of the forward gather: Flash-RS, own block last)
    wgrad    dw = AG(x)^T @ dy          (x re-gathered with Flash-AG, dw summed slice by slice as shards
                                         arrive, fused into the same ring walk as the dgrad RS; or from the
                                         gathered x kept in forward: `keep_gathered`, memory for time)
    bgrad    db = sum_{s,b} dy

This file: the forward plain functions (no autograd), one per algorithm, all with one signature
(x_shard, weight, bias, group, ctx, plan) -> (y, AG(x) or None), registered in ops/registry.py; each reads the
knobs of the OpPlan it uses (ops/registry.py): plan.keep_gathered; slicing: plan.num_chunks; flash: the ring's
direction and plan.hops, row sub-chunks per hop, each posted ahead as its own transfer and multiplied as
soon as it arrived (ops/tp_sp/hops.py). functions.py holds the autograd.Function and the public wrapper;
backward.py the backward.
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from ...runtime import all_gather_into, gather_and_consume, group_info, rows_writer, wait_collective
from ...runtime.handlers import chunk_bounds
from ..registry import register, ring_of

OP = "all_gather_matmul"


def gather_reference(x_shard, group):
    """Stock all-gather along dim 0: [s/P, ...] -> [s, ...]."""
    rank, world = group_info(group)
    full = torch.empty((x_shard.shape[0] * world,) + tuple(x_shard.shape[1:]), dtype=x_shard.dtype,
                       device=x_shard.device)
    all_gather_into(full, x_shard.contiguous(), group)
    return full


def timed_gather(x_shard, group, ctx):
    """gather_reference, traced: the blocking collective is in flight and waited on at once."""
    t = time.perf_counter()
    full = gather_reference(x_shard, group)
    ctx.record("post", "all-gather", t)
    ctx.record("wait", "all-gather", t)
    return full


def gathered_output(x_shard, n: int, world: int, dtype) -> torch.Tensor:
    """y [s, b, n] for a gather of x_shard [s/P, b, h] over `world` ranks, in `dtype`."""
    return torch.empty((x_shard.shape[0] * world,) + tuple(x_shard.shape[1:-1]) + (n,), dtype=dtype,
                       device=x_shard.device)


@register(OP, "reference")
def ag_matmul_reference(x_shard, weight, bias, group, ctx, plan):
    """Unfused: one all-gather, then one GEMM. Returns (y, gathered x or None)."""
    full = timed_gather(x_shard, group, ctx)
    t = time.perf_counter()
    y = F.linear(full, weight, bias)
    ctx.record("compute", "whole GEMM", t)
    return y, (full if plan.keep_gathered else None)


@register(OP, "flash")
@register(OP, "flash_bidir")
def ag_matmul_ring(x_shard, weight, bias, group, ctx, plan):
    """Flash-AG: the ring of all_gather_ring; each arrived shard is multiplied while the next one flies."""
    y = gathered_output(x_shard, weight.shape[0], group_info(group)[1], x_shard.dtype)
    consume = rows_writer(y, weight, bias)  # y[span] = xs @ w^T + bias, straight into y's rows
    gathered = gather_and_consume(x_shard, consume, group, ctx, ring_of(plan, "ag"), keep_gathered=plan.keep_gathered)
    return y, gathered


def sliced_gather(x_shard, consume, group, ctx, plan):
    """All-gather of x_shard [s/P, ...] in plan.num_chunks row chunks, all posted at once; consume(a, b, buf)
    as chunk rows a:b arrive, buf [P, b - a, ...]. -> AG(x) [s, ...] if plan.keep_gathered, else None."""
    world, tail = group_info(group)[1], tuple(x_shard.shape[1:])
    chunks = [x_shard[a:b] for a, b in chunk_bounds(x_shard.shape[0], plan.num_chunks)]
    bufs = [torch.empty((world,) + tuple(c.shape), dtype=c.dtype, device=c.device) for c in chunks]
    t = time.perf_counter()
    works = [all_gather_into(b.view(-1, *tail), c.contiguous(), group, async_op=True) for b, c in zip(bufs, chunks)]
    for j in range(len(works)):
        ctx.record("post", f"chunk {j}", t)
    start = 0
    for j, (buf, c, w) in enumerate(zip(bufs, chunks, works)):
        t = time.perf_counter()
        wait_collective([w], group, x_shard.device, ctx.timeout, f"all-gather chunk {j}")
        ctx.record("wait", f"chunk {j}", t)
        t = time.perf_counter()
        consume(start, start + c.shape[0], buf)
        ctx.record("compute", f"chunk {j}", t)
        start += c.shape[0]
    if not plan.keep_gathered:
        return None
    return torch.cat(bufs, dim=1).view(-1, *tail)  # [P, s/P, b, h] -> [s, b, h]


@register(OP, "slicing")
def ag_matmul_slicing(x_shard, weight, bias, group, ctx, plan):
    """Data slicing (the Megatron/TE pipeline baseline): all-gather chunk j+1.. while chunk j multiplies.
    The first gather is exposed (the head); chunks are cut along the local sequence."""
    world = group_info(group)[1]
    y = gathered_output(x_shard, weight.shape[0], world, x_shard.dtype)
    y_blocks = y.view(world, x_shard.shape[0], *y.shape[1:])  # [P, s/P, b, n/P]

    def consume(a, b, buf):
        y_blocks[:, a:b] = F.linear(buf, weight, bias)  # [P, c, b, n/P]: one GEMM per chunk
    return y, sliced_gather(x_shard, consume, group, ctx, plan)
