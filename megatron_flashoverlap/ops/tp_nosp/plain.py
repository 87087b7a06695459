"""Tensor parallel WITHOUT sequence parallel: GEMM + all-reduce, decomposed into Flash-RS + Flash-AG.

Row-parallel (forward all-reduce):
    x_k [s, b, k/P]    weight_k [h, k/P]    y [s, b, h]  (replicated: every rank holds the same bits)
    forward  y = AR(x @ w^T) = AG(RS(x @ w^T))
    dgrad    dx = dy @ w        (dy is replicated: no communication)
    wgrad    dw = dy^T @ x      (local)
Column-parallel (backward all-reduce, Megatron's `allreduce_dgrad`), the dual:
    x [s, b, h] (replicated)    weight_n [n/P, h]    y_n [s, b, n/P]
    forward  y = x @ w^T + bias (local)
    dgrad    dx = AR(dy @ w)    the same decomposed all-reduce, with the wgrad filling its tail
    wgrad    dw = dy^T @ x      bgrad db = sum dy

The decomposition ("flash"): the sequence is cut in C chunks of whole rank-blocks (multiples of P rows).
Chunk c is a Flash-RS (its GEMM slices produce partials, own block last); the all-gather of its reduced
block then rides in the same ring walk as the GEMM slices of chunk c+1 (merged schedules, tags 0 / 1):

    walk     | chunk 0       | chunk 1             | ... | chunk C-1               | tail
    comm     | RS0 hops      | RS1 hops + AG0 hops | ... | RS(C-1) + AG(C-2) hops  | AG(C-1) hops
    compute  | GEMM0 slices  | GEMM1 slices        | ... | GEMM(C-1) slices        | forward: nothing (EXPOSED)
                                                                                     | column dgrad: wgrad slices

What stays exposed in forward: the tail, P-1 hops of s/(C*P) * b * h elements (1/C of an all-gather of y),
plus any hop that outlasts the GEMM slice it rides with, plus the final add of each Flash-RS. In the
column backward the wgrad GEMM (cut in P-1 slices) hides the tail too. Partial sums are kept in fp32 for
bf16/fp16 and travel in the wire dtype (OpPlan.wire_dtype: "input", stock's bytes, rounded once per hop, or "fp32");
the reduced block is rounded once before the all-gather, so every rank ends with identical bits. The
reference and slicing all-reduce in the wire dtype too (wire_dtype="input": stock).
Sequence not divisible by P: the caller pads x with zero rows to a multiple of P (autograd.py
ar_matmul_forward) and keeps the first s rows of y; the plain functions here see divisible inputs.

This file: the plain functions (no autograd), one per algorithm, one signature
(x, weight, group, ctx, plan, tail=None) -> y, registered as "matmul_all_reduce" in ops/registry.py; each
reads the OpPlan knobs it uses (plan.wire_dtype; slicing and flash: plan.num_chunks; flash: the ring's direction);
`tail = (n, fn)`: n independent compute pieces fn(i) that run while the all-reduce's last part flies.
autograd.py holds the autograd.Functions and the public wrappers.
"""
from __future__ import annotations

import torch.distributed as dist

from ...runtime import gather, group_info, partial_linear, scatter, sums, tail as tail_pass, wait_collective
from ...runtime import walk, wire_dtype
from ...runtime.handlers import chunk_bounds
from ...runtime.numerics import partial_producer, rows_writer
from ..registry import register, ring_of

OP = "matmul_all_reduce"
DEFAULT_CHUNKS = 2  # C: the forward tail is 1/C of the all-gather; more chunks = smaller GEMM slices


def chunk_rows(rows: int, world: int, chunks: int) -> list[tuple[int, int]]:
    """Row ranges of the C sequence chunks, each a whole number of rank-blocks (a multiple of P rows)."""
    return [(a * world, b * world) for a, b in chunk_bounds(rows // world, chunks)]


def _run_tail(tail) -> None:
    if tail is not None:
        for piece in range(tail[0]):
            tail[1](piece)


def all_reduce_whole(y, group, ctx, tail=None) -> None:
    """y [*] (the whole partial, in the wire dtype) summed in place by one `dist.all_reduce`, async, the `tail`
    pieces run while it flies (the reference of every all-reduce GEMM operator)."""
    work = dist.all_reduce(y, group=group, async_op=True) if group_info(group)[1] > 1 else None
    _run_tail(tail)
    if work is not None:
        wait_collective([work], group, y.device, ctx.timeout, "all-reduce")


@register(OP, "reference")
def ar_matmul_reference(x, weight, group, ctx, plan, tail=None):
    """Unfused, as stock Megatron: one GEMM, then one `dist.all_reduce` (in the wire dtype); with `tail` (the
    column backward's wgrad) the all-reduce is async and the tail runs while it flies (`allreduce_dgrad`)."""
    y = partial_linear(x, weight).to(wire_dtype(x.dtype, plan.wire_dtype))
    all_reduce_whole(y, group, ctx, tail)
    return y.to(x.dtype)


def all_reduce_sliced(y, fill, group, ctx, plan, tail=None) -> None:
    """Data slicing of the all-reduce of y [s, ...] (the wire dtype): fill(a, b) writes partial rows a:b, whose
    all-reduce is in flight while the next chunk is filled; the last is the tail (in the column backward the
    wgrad runs before the final wait, as Megatron's async dgrad all-reduce)."""
    works = []
    for a, b in chunk_bounds(y.shape[0], plan.num_chunks):
        fill(a, b)
        works.append(dist.all_reduce(y[a:b], group=group, async_op=True))
    _run_tail(tail)
    wait_collective(works, group, y.device, ctx.timeout, f"all-reduce of {len(works)} chunks")


@register(OP, "slicing")
def ar_matmul_slicing(x, weight, group, ctx, plan, tail=None):
    """Data slicing: the all-reduce of chunk j in flight while chunk j+1 multiplies (all_reduce_sliced)."""
    y = x.new_empty(tuple(x.shape[:-1]) + (weight.shape[0],), dtype=wire_dtype(x.dtype, plan.wire_dtype))
    write = rows_writer(y, weight) if y.dtype == x.dtype else None  # in place where the GEMM's dtype is y's

    def fill(a, b):
        if write is not None:
            write((a, b), x[a:b])
        else:
            y[a:b] = partial_linear(x[a:b], weight)
    all_reduce_sliced(y, fill, group, ctx, plan, tail)
    return y.to(x.dtype)


def all_reduce_ring(y, producer_at, sum_rule, group, ctx, plan, tail=None):
    """Chunked Flash-RS + Flash-AG (module docstring) into y [s, ..., h] (the output dtype): chunk c's RS of the
    partials producer_at(a) makes (a Producer of the chunk starting at row a), chunk c-1's AG in one walk; the
    last AG with the `tail` pieces spread over its hops. plan.num_chunks: C (None: DEFAULT_CHUNKS). -> y."""
    world = group_info(group)[1]
    rs_ring, ag_ring = ring_of(plan, "ar.rs"), ring_of(plan, "ar.ag", tag=1)
    pending = None  # the all-gather pass still to run
    for a, b in chunk_rows(y.shape[0], world, plan.num_chunks or DEFAULT_CHUNKS):
        block = ((b - a) // world,) + tuple(y.shape[1:])  # [rows of the chunk / P, b, h]
        rs = scatter(producer_at(a), block, sum_rule, group, ctx, rs_ring)
        walk(group, ctx, rs, pending)
        pending = _gather_into(rs.handler.result(), y[a:b], group, ctx, ag_ring)
    walk(group, ctx, pending, None if tail is None else tail_pass(tail[0], tail[1], group, tag=2))
    return y


@register(OP, "flash")
@register(OP, "flash_bidir")
def ar_matmul_ring(x, weight, group, ctx, plan, tail=None):
    """Chunked Flash-RS + Flash-AG (all_reduce_ring), each partial x[rows] @ w^T."""
    y = x.new_empty(tuple(x.shape[:-1]) + (weight.shape[0],))
    return all_reduce_ring(y, lambda a: partial_producer(x, weight, offset=a), sums(x.dtype, x.device, plan.wire_dtype),
                           group, ctx, plan, tail)


def _gather_into(block, y_chunk, group, ctx, ring):
    """The all-gather pass of one reduced chunk: every arrived block is copied into its rows of y_chunk."""
    def consume(span, ys):
        y_chunk[span[0]:span[1]].copy_(ys)

    return gather(block, consume, group, ctx, ring)
