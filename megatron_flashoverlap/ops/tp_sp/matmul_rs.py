"""GEMM + reduce-scatter (row-parallel under sequence parallel): forward plain functions.

    x_k [s, b, k/P]    weight_k [h, k/P]    y_s [s/P, b, h]

    forward  y = RS(x @ w^T)       partial sums kept in fp32 when x is bf16/fp16; they travel in the
                                   input dtype (wire_dtype="input", stock's bytes: rounded once per hop, the
                                   arrival upcast-added) or in fp32 (wire_dtype="fp32"); the own block is
                                   rounded once to the input dtype at the end (runtime/numerics.py)
    dgrad    dx = AG(dy) @ w       (the dual: Flash-AG of dy, local shard first; backward.py)
    wgrad    dw = AG(dy)^T @ x     (summed slice by slice as dy shards arrive, in the same ring walk)

All plain functions share one signature: (x, weight, group, ctx, plan) -> y_s (registered in
ops/registry.py), reading the knobs of the OpPlan they use: plan.wire_dtype; slicing: plan.num_chunks; flash: the
ring's direction and plan.hops, row sub-chunks per block, each partial sent as soon as it is made
(ops/tp_sp/hops.py). The reference and slicing reduce-scatter in the wire dtype too (wire_dtype="input": stock).
"""
from __future__ import annotations

import time

import torch

from ...runtime import group_info, partial_linear, produce_and_scatter, reduce_scatter_into, sums, wait_collective
from ...runtime import wire_dtype
from ...runtime.numerics import partial_producer
from ...runtime.handlers import chunk_bounds
from ..registry import register, ring_of

OP = "matmul_reduce_scatter"


def scatter_reference(partial, dtype, group, ctx):
    """Stock reduce-scatter of partial [s, ...] (already in the wire dtype) -> [s/P, ...] in `dtype`, traced:
    the blocking collective is in flight and waited on at once. A group of one: the partial itself."""
    world = group_info(group)[1]
    if world == 1:
        return partial.to(dtype)
    out = torch.empty((partial.shape[0] // world,) + tuple(partial.shape[1:]), dtype=partial.dtype,
                      device=partial.device)
    t = time.perf_counter()
    reduce_scatter_into(out, partial.contiguous(), group)
    ctx.record("post", "reduce-scatter", t)
    ctx.record("wait", "reduce-scatter", t)
    return out.to(dtype)


@register(OP, "reference")
def rs_matmul_reference(x, weight, group, ctx, plan):
    """Unfused: one GEMM, then one stock reduce-scatter in the wire dtype (wire_dtype="input": stock Megatron)."""
    t = time.perf_counter()
    partial = partial_linear(x, weight).to(wire_dtype(x.dtype, plan.wire_dtype))  # [s, b, h]
    ctx.record("compute", "whole GEMM", t)
    return scatter_reference(partial, x.dtype, group, ctx)


@register(OP, "flash")
@register(OP, "flash_bidir")
def rs_matmul_ring(x, weight, group, ctx, plan):
    """Flash-RS: produce the partial of the block the next hop carries; own block last, no tail."""
    world = group_info(group)[1]
    block = (x.shape[0] // world,) + tuple(x.shape[1:-1]) + (weight.shape[0],)  # [s/P, b, h]
    return produce_and_scatter(partial_producer(x, weight), block, sums(x.dtype, x.device, plan.wire_dtype), group, ctx,
                               ring_of(plan, "rs"))


def sliced_scatter(partial, x, h: int, dtype, group, ctx, plan):
    """Data slicing of RS(x [s, b, k] @ .): partial(xb [P, c, b, k], wire dtype) -> [P, c, b, h] for row chunk
    a:b of every rank block, its reduce-scatter in flight while the next chunk multiplies (the last is the
    tail); each chunk is reduce-scattered into its rows of one output [s/P, b, h] in `dtype` (the
    activations': the wire dtype follows it).
    The chunk is copied contiguous first (a copy of its input, linear time) so its GEMM is one BLAS mm: a GEMM
    on the strided [P, c, b, k] view took a batched path 12-15x slower than the unsplit reference."""
    world = group_info(group)[1]
    rows = x.shape[0] // world
    xb = x.view(world, rows, *x.shape[1:]) if x.is_contiguous() else x.reshape(world, rows, *x.shape[1:])
    wdt = wire_dtype(dtype, plan.wire_dtype)
    out = torch.empty((rows,) + tuple(x.shape[1:-1]) + (h,), dtype=wdt, device=x.device)
    works = []
    for j, (a, b) in enumerate(chunk_bounds(rows, plan.num_chunks)):
        t = time.perf_counter()
        part = partial(xb[:, a:b].contiguous(), wdt)  # [P, c, b, h], contiguous
        ctx.record("compute", f"chunk {j}", t)
        t = time.perf_counter()
        works.append(reduce_scatter_into(out[a:b], part.view(-1, *part.shape[2:]), group, async_op=True))
        ctx.record("post", f"chunk {j}", t)
    for j, w in enumerate(works):
        t = time.perf_counter()
        wait_collective([w], group, x.device, ctx.timeout, f"reduce-scatter chunk {j}")
        ctx.record("wait", f"chunk {j}", t)
    return out.to(dtype)


@register(OP, "slicing")
def rs_matmul_slicing(x, weight, group, ctx, plan):
    """Data slicing: reduce-scatter of chunk j in flight while chunk j+1 multiplies (sliced_scatter)."""
    return sliced_scatter(lambda xc, wdt: partial_linear(xc, weight).to(wdt), x, weight.shape[0], x.dtype, group, ctx,
                          plan)
