"""Tensor parallel with sequence parallel, the plain functions (no autograd): both operators, forward and
backward, one function per algorithm, registered in ops/registry.py. The autograd face is autograd.py; the FP8
twins are plain_fp8.py.

    column  x_shard_s [s/P, b, h]   weight_n [n/P, h]   bias_n [n/P]   y [s, b, n/P]
        forward  y = AG(x) @ w^T + bias
        dgrad    dx = RS(dy @ w)        the dual of the forward gather: Flash-RS, own block last
        wgrad    dw = AG(x)^T @ dy      x gathered again on the dgrad's walk, or kept from the forward
        bgrad    db = sum_{s,b} dy      (plan.keep_gathered: memory for time)
    row     x_k [s, b, k/P]   weight_k [h, k/P]   y_s [s/P, b, h]
        forward  y = RS(x @ w^T)        partials summed in fp32 for bf16/fp16, sent in plan.wire_dtype
        dgrad    dx = AG(dy) @ w        the dual: Flash-AG of dy, local shard first
        wgrad    dw = AG(dy)^T @ x      summed slice by slice as dy shards arrive, on the same walk

Signatures (op key, then arguments):
    AG_OP   (x_shard, weight, bias, group, ctx, plan) -> (y, AG(x) if plan.keep_gathered else None)
    RS_OP   (x, weight, group, ctx, plan) -> y_s
    COLUMN  (dy, x_shard, gathered, weight, group, ctx, plan, dw) -> (dx, dW or None)
    ROW     (dy, x, weight, group, ctx, plan, dw) -> (dx, dW or None)
Algorithms: "reference" (the stock collective, then one GEMM), "slicing" (plan.num_chunks chunks, each one's
collective in flight while the next multiplies; the head or tail stays exposed), "flash" and "flash_bidir" (the
ring of ops/registry.ring_of; plan.hop_chunks row sub-chunks per hop, see hop_chunks_for).

The column's flash backward is ONE walk of two passes, each step one dgrad slice and one wgrad slice while
both hops fly:

    comm    | RS hop i  + AG hop i | RS hop i+1 + AG hop i+1 | ...
    compute | dy[d_i] @ w, dw += dy[src_i]^T x[src_i]        | ...

Weight gradients are summed in fp32 for bf16/fp16 (slice order differs from one GEMM's). `dw` (a WgradRoute) says
where dW goes: `into` (e.g. Megatron's fp32 main_grad): each slice added in place, dW returned None; `fn(dy_full,
x_full)` (e.g. the DP reduce-scatter of dW, megatron/ddp/grad_sync.py): the walk keeps the operand it gathers and
hands this rank's complete dW operands to fn once; neither: dW summed and returned; dw None: no dW.
"""
from __future__ import annotations

import functools
import time
from dataclasses import replace

import torch
import torch.nn.functional as F

from ...runtime import all_gather_into, gather, gather_and_consume, group_info, partial_linear, produce_and_scatter
from ...runtime import reduce_scatter_into, rows_writer, scatter, sums, wait_collective, walk, wgrad, wire_dtype
from ...runtime.handlers import chunk_bounds
from ...runtime.numerics import add_wgrad, partial_producer, wgrad_result, wgrad_target
from ..registry import OpPlan, keeping, register, ring_of

AG_OP, RS_OP = "all_gather_matmul", "matmul_reduce_scatter"
COLUMN, ROW = f"{AG_OP}.backward", f"{RS_OP}.backward"


def gather_reference(x_shard, group, async_op: bool = False):
    """Stock all-gather along dim 0: [s/P, ...] -> [s, ...]; async_op: (that buffer, its work) while it flies."""
    rank, world = group_info(group)
    full = torch.empty((x_shard.shape[0] * world,) + tuple(x_shard.shape[1:]), dtype=x_shard.dtype,
                       device=x_shard.device)
    work = all_gather_into(full, x_shard.contiguous(), group, async_op=async_op)
    return (full, work) if async_op else full


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


@register(AG_OP, "reference")
def ag_matmul_reference(x_shard, weight, bias, group, ctx, plan):
    """Unfused: one all-gather, then one GEMM. Returns (y, gathered x or None)."""
    full = timed_gather(x_shard, group, ctx)
    t = time.perf_counter()
    y = F.linear(full, weight, bias)
    ctx.record("compute", "whole GEMM", t)
    return y, (full if plan.keep_gathered else None)


@register(AG_OP, "flash")
@register(AG_OP, "flash_bidir")
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


@register(AG_OP, "slicing")
def ag_matmul_slicing(x_shard, weight, bias, group, ctx, plan):
    """Data slicing (the Megatron/TE pipeline baseline): all-gather chunk j+1.. while chunk j multiplies.
    The first gather is exposed (the head); chunks are cut along the local sequence."""
    world = group_info(group)[1]
    y = gathered_output(x_shard, weight.shape[0], world, x_shard.dtype)
    y_blocks = y.view(world, x_shard.shape[0], *y.shape[1:])  # [P, s/P, b, n/P]

    def consume(a, b, buf):
        y_blocks[:, a:b] = F.linear(buf, weight, bias)  # [P, c, b, n/P]: one GEMM per chunk
    return y, sliced_gather(x_shard, consume, group, ctx, plan)


def scatter_reference(partial, dtype, group, ctx, tail=None):
    """Stock reduce-scatter of partial [s, ...] (already in the wire dtype) -> [s/P, ...] in `dtype`, traced:
    the blocking collective is in flight and waited on at once; with `tail`, posted async and tail() runs while
    it flies (Megatron's column backward runs its wgrad there), then a timed wait. A group of one: the partial
    itself (tail run first)."""
    world = group_info(group)[1]
    if world == 1:
        if tail is not None:
            tail()
        return partial.to(dtype)
    out = torch.empty((partial.shape[0] // world,) + tuple(partial.shape[1:]), dtype=partial.dtype,
                      device=partial.device)
    t = time.perf_counter()
    work = reduce_scatter_into(out, partial.contiguous(), group, async_op=tail is not None)
    ctx.record("post", "reduce-scatter", t)
    if tail is not None:
        tail()
        t = time.perf_counter()
        wait_collective([work], group, partial.device, ctx.timeout, "reduce-scatter")
    ctx.record("wait", "reduce-scatter", t)
    return out.to(dtype)


@register(RS_OP, "reference")
def rs_matmul_reference(x, weight, group, ctx, plan):
    """Unfused: one GEMM, then one stock reduce-scatter in the wire dtype (wire_dtype="input": stock Megatron)."""
    t = time.perf_counter()
    partial = partial_linear(x, weight).to(wire_dtype(x.dtype, plan.wire_dtype))  # [s, b, h]
    ctx.record("compute", "whole GEMM", t)
    return scatter_reference(partial, x.dtype, group, ctx)


@register(RS_OP, "flash")
@register(RS_OP, "flash_bidir")
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
    The chunk is copied contiguous first (a copy of its input, linear time) so its GEMM is one BLAS mm: on the
    strided [P, c, b, k] view BLAS takes a batched path, many times slower than the unsplit reference."""
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


@register(RS_OP, "slicing")
def rs_matmul_slicing(x, weight, group, ctx, plan):
    """Data slicing: reduce-scatter of chunk j in flight while chunk j+1 multiplies (sliced_scatter)."""
    return sliced_scatter(lambda xc, wdt: partial_linear(xc, weight).to(wdt), x, weight.shape[0], x.dtype, group, ctx,
                          plan)

# ---- hop_chunks: how many row sub-chunks one hop of the flash ring is cut in (c) ----
#     hop [rows/P, k] -> c transfers of [rows/(P c), k], all posted ahead (schedules/ring.py)
# A sub-chunk's GEMM slice starts as soon as it arrives (all-gather), its partial leaves as soon as it is made
# (reduce-scatter): c shrinks the one slice a link-bound block cannot overlap from C/P to C/(P c), for c - 1 more
# posts and waits per hop. The operator cannot see the link, so an open request is one transfer per hop; a
# layer whose hop is long against its slice sets hop_chunks in its plan, the planner fills it where the YAML
# leaves it open (plan/probe_plan.py; measured in benchmarks/overlap/RESULTS.md, "Hop sub-chunks at P = 2"), and
# an auto layer's chooser times c = 2 beside c = 1 on the real group (megatron/train_choice.py).

def hop_chunks_for(algo: str, requested, shard_rows: int) -> int:
    """-> c for the algorithm that runs: "flash" takes the request (None: 1) capped at shard_rows so every
    sub-chunk keeps a row (the same cap on every rank); any other algorithm (e.g. under force_reference): 1."""
    if algo != "flash":
        return 1
    return max(1, min(requested or 1, shard_rows))


@functools.lru_cache(maxsize=1024)
def sized(plan: OpPlan, shard_rows: int) -> OpPlan:
    """`plan` with hop_chunks fixed for this shard (flash); any other algo as it is."""
    if plan.algo != "flash":
        return plan
    c = hop_chunks_for(plan.algo, plan.hop_chunks, shard_rows)
    return plan if c == plan.hop_chunks else replace(plan, hop_chunks=c)



def _whole_wgrad(dy, x, weight, dw):
    """The unfused paths' one wgrad GEMM, where `dw` routes it: dw.fn's, added into dw.into, or
    dy^T x rounded to weight.dtype (stock); None when no dW is wanted."""
    if dw is None:
        return None
    if dw.fn is not None:
        return dw.fn(dy, x)
    if dw.into is None:
        return wgrad(dy, x).to(weight.dtype)
    add_wgrad(dw.into, dy, x)
    return None


def _column_dw(dy, x_shard, gathered, weight, group, dw):
    """dW of the unfused column backward from AG(x): kept, or re-gathered with the stock collective."""
    if dw is None:
        return None
    return _whole_wgrad(dy, gathered if gathered is not None else gather_reference(x_shard, group), weight, dw)


def stock_column_backward(partial_of, x_bytes, wgrad_of, out_dtype, group, ctx):
    """Stock Megatron's column backward under SP (tensor_parallel.layers.LinearWithGradAccumulationAndAsync-
    Communication): the re-gather of x_bytes [s/P, ...] (None: kept from the forward, or no dW wanted) in flight
    under the dgrad GEMM partial_of() -> dy @ w [s, ...] (the wire dtype), then the stock reduce-scatter of that
    partial in flight under the wgrad wgrad_of(AG(x_bytes) [s, ...] or None). -> (dx [s/P, ...] in out_dtype,
    wgrad_of's result). The same arithmetic as the blocking order, only the waits move."""
    full, work = (x_bytes if group_info(group)[1] == 1 else None), None  # a group of one: nothing to gather
    if x_bytes is not None and full is None:
        t = time.perf_counter()
        full, work = gather_reference(x_bytes, group, async_op=True)
        ctx.record("post", "all-gather", t)
    t = time.perf_counter()
    partial = partial_of()
    ctx.record("compute", "whole GEMM", t)
    if work is not None:
        t = time.perf_counter()
        wait_collective([work], group, partial.device, ctx.timeout, "all-gather")
        ctx.record("wait", "all-gather", t)
    dw = []
    dx = scatter_reference(partial, out_dtype, group, ctx, tail=lambda: dw.append(wgrad_of(full)))
    return dx, dw[0]


@register(COLUMN, "reference")
def column_backward_reference(dy, x_shard, gathered, weight, group, ctx, plan, dw):
    """-> (dx [s/P, b, h], dW [n/P, h] or None): stock RS of dy @ w under dW = AG(x)^T dy, AG(x) re-gathered
    under the dgrad (stock_column_backward)."""
    regather = x_shard if dw is not None and gathered is None else None
    return stock_column_backward(
        lambda: partial_linear(dy, weight.t()).to(wire_dtype(dy.dtype, plan.wire_dtype)), regather,
        lambda full: _whole_wgrad(dy, gathered if gathered is not None else full, weight, dw), dy.dtype, group, ctx)


@register(COLUMN, "slicing")
def column_backward_slicing(dy, x_shard, gathered, weight, group, ctx, plan, dw):
    return rs_matmul_slicing(dy, weight.t(), group, ctx, plan), _column_dw(dy, x_shard, gathered, weight, group, dw)


@register(COLUMN, "flash")
@register(COLUMN, "flash_bidir")
def column_backward_ring(dy, x_shard, gathered, weight, group, ctx, plan, dw):
    """The dgrad RS and the wgrad AG of x in ONE walk; from a kept AG(x) only the RS runs on the ring."""
    if gathered is None and dw is not None:
        return _column_backward_merged(dy, x_shard, weight, group, ctx, plan, dw)
    return rs_matmul_ring(dy, weight.t(), group, ctx, plan), _column_dw(dy, x_shard, gathered, weight, group, dw)


def _column_backward_merged(dy, x_shard, weight, group, ctx, plan, dw):
    acc = wgrad_target(weight, dw.into) if dw.fn is None else None
    full = None if dw.fn is None else x_shard.new_empty((dy.shape[0],) + tuple(x_shard.shape[1:]))  # [s, b, h]

    def consume(span, xs):
        if full is not None:
            full[span[0]:span[1]].copy_(xs)  # AG(x) kept for dw.fn
        else:
            add_wgrad(acc, dy[span[0]:span[1]], xs)  # += dy[span]^T xs, in place

    block = (x_shard.shape[0],) + tuple(dy.shape[1:-1]) + (weight.shape[1],)  # [s/P, b, h]
    rs = scatter(partial_producer(dy, weight.t()), block, sums(dy.dtype, dy.device, plan.wire_dtype), group, ctx,
                 ring_of(plan, "bwd.rs", tag=0))
    ag = gather(x_shard, consume, group, ctx, ring_of(plan, "bwd.ag", tag=1))
    walk(group, ctx, rs, ag)
    if full is not None:
        return rs.handler.result(), dw.fn(dy, full)
    return rs.handler.result(), wgrad_result(weight, acc, dw.into)


def _row_unfused(ag_matmul, dy, x, weight, group, ctx, plan, dw):
    dx, full = ag_matmul(dy, weight.t(), None, group, ctx, keeping(plan))
    return dx, _whole_wgrad(full, x, weight, dw)


@register(ROW, "reference")
def row_backward_reference(dy, x, weight, group, ctx, plan, dw):
    """-> (dx [s, b, k/P], dW [h, k/P] or None): stock AG of dy, then the two GEMMs."""
    return _row_unfused(ag_matmul_reference, dy, x, weight, group, ctx, plan, dw)


@register(ROW, "slicing")
def row_backward_slicing(dy, x, weight, group, ctx, plan, dw):
    return _row_unfused(ag_matmul_slicing, dy, x, weight, group, ctx, plan, dw)


@register(ROW, "flash")
@register(ROW, "flash_bidir")
def row_backward_ring(dy, x, weight, group, ctx, plan, dw):
    """One Flash-AG of dy; each arrived dy shard gives its dx rows and adds to dW (or to dw.into), or is
    kept in AG(dy) for dw.fn."""
    fn = None if dw is None else dw.fn
    into = None if dw is None else dw.into
    out = torch.empty(tuple(x.shape), dtype=x.dtype, device=x.device)  # dx
    acc = wgrad_target(weight, into, dw is not None) if fn is None else None
    full = None if fn is None else dy.new_empty(tuple(x.shape[:-1]) + (dy.shape[-1],))  # AG(dy) [s, b, h]
    write_dx = rows_writer(out, weight.t())

    def consume(span, dys):
        write_dx(span, dys)  # dx[span] = dys @ w, straight into dx's rows
        if full is not None:
            full[span[0]:span[1]].copy_(dys)
        elif acc is not None:
            add_wgrad(acc, dys, x[span[0]:span[1]])

    gather_and_consume(dy, consume, group, ctx, ring_of(plan, "bwd.ag"))
    return out, (fn(full, x) if fn is not None else wgrad_result(weight, acc, into))
