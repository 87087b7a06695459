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
column backward the wgrad GEMM (cut in P-1 slices) hides the tail too. Partial sums travel in fp32 for
bf16/fp16 and are rounded once before the all-gather, so every rank ends with identical bits.
Sequence not divisible by P: one log line, then the reference (GEMM, then `dist.all_reduce`).
"""
from __future__ import annotations

import logging

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ...runtime import OverlapContext, execute, group_info
from ...schedules import Schedule, Slice, Step, all_gather_ring, merge, reduce_scatter_ring
from ..registry import resolve
from ..all_reduce.all_reduce import all_reduce
from ..all_reduce.select import is_decode_shaped
from ..tp_sp.backward import _wgrad
from ..checks import checked_context
from ..tp_sp.matmul_rs import acc_dtype
from ...runtime.handlers import GatherPass, ScatterPass, chunk_bounds

log = logging.getLogger(__name__)
DEFAULT_CHUNKS = 2  # C: the forward tail is 1/C of the all-gather; more chunks = smaller GEMM slices
_LOGGED: set = set()


def _log_once(key, msg: str) -> None:
    if key not in _LOGGED:
        _LOGGED.add(key)
        log.warning(msg)


def chunk_rows(rows: int, world: int, chunks: int) -> list[tuple[int, int]]:
    """Row ranges of the C sequence chunks, each a whole number of rank-blocks (a multiple of P rows)."""
    return [(a * world, b * world) for a, b in chunk_bounds(rows // world, chunks)]


# ---------------------------------------------------------------- plain functions (no autograd)

def ar_matmul_reference(x, weight, group, ctx, tail=None):
    """Unfused, as stock Megatron: one GEMM, then one `dist.all_reduce`; with `tail` (the column backward's
    wgrad) the all-reduce is async and the tail runs while it flies (Megatron's `allreduce_dgrad`)."""
    y = F.linear(x, weight)
    rank, world = group_info(group)
    work = dist.all_reduce(y, group=group, async_op=True) if world > 1 else None
    if tail is not None:
        for piece in range(tail[0]):
            tail[1](piece)
    if work is not None:
        work.wait(ctx.timeout)
    return y


def ar_matmul_slicing(x, weight, group, ctx, num_chunks, tail=None):
    """Data slicing: the all-reduce of chunk j in flight while chunk j+1 multiplies; the last is the tail
    (in the column backward the wgrad runs before the final wait, as Megatron's async dgrad all-reduce)."""
    y = torch.empty(tuple(x.shape[:-1]) + (weight.shape[0],), dtype=x.dtype, device=x.device)
    works = []
    for a, b in chunk_bounds(x.shape[0], num_chunks):
        y[a:b] = F.linear(x[a:b], weight)
        works.append(dist.all_reduce(y[a:b], group=group, async_op=True))
    if tail is not None:
        for piece in range(tail[0]):
            tail[1](piece)
    for w in works:
        w.wait(ctx.timeout)
    return y


def ar_matmul_flash(x, weight, group, ctx, num_chunks=DEFAULT_CHUNKS, bidirectional=False, tail=None):
    """Chunked Flash-RS + Flash-AG (module docstring). `tail = (n, fn)`: n independent compute pieces
    `fn(i)` spread over the hops of the last all-gather (the column backward passes its wgrad)."""
    rank, world = group_info(group)
    y = torch.empty(tuple(x.shape[:-1]) + (weight.shape[0],), dtype=x.dtype, device=x.device)
    pending = None  # (schedule, pass) of the all-gather still to run
    for a, b in chunk_rows(x.shape[0], world, num_chunks):
        rs_s = reduce_scatter_ring(rank, world, bidirectional=bidirectional, tag=0)
        rs = ScatterPass((b - a) // world, rank, rs_s.parts,
                         lambda span, a=a: F.linear(x[a + span[0]:a + span[1]], weight),
                         tuple(y.shape[1:]), acc_dtype(x.dtype), x.dtype, x.device, ctx, name="ar.rs", tag=0)
        _walk(group, ctx, (rs_s, rs), pending)
        pending = _gather(rs.result(), y[a:b], rank, world, bidirectional, ctx)
    _walk(group, ctx, pending, _tail_schedule(rank, world, tail))
    return y


def _gather(block, y_chunk, rank, world, bidirectional, ctx):
    """The all-gather of one reduced chunk: every arrived block is copied into its rows of y_chunk."""
    def consume(span, ys):
        y_chunk[span[0]:span[1]].copy_(ys)

    sched = all_gather_ring(rank, world, bidirectional=bidirectional, tag=1)
    return sched, GatherPass(block, rank, world, sched.parts, consume, ctx, name="ar.ag", tag=1)


class _TailPass:
    """Compute-only handler: runs piece i of independent work (no transfers of its own)."""

    tag = 2

    def __init__(self, fn):
        self.fn = fn

    def compute(self, x: Slice) -> None:
        self.fn(x.block)


def _tail_schedule(rank, world, tail):
    """Tail pieces 0..n-1 as tag-2 compute slices, one per hop step of the last all-gather."""
    if tail is None or tail[0] == 0:
        return None
    n, fn = tail
    per = [[i for i in range(n) if i % max(world - 1, 1) == s] for s in range(max(world - 1, 1))]
    steps = tuple(Step(compute=tuple(Slice(i, 0, 2) for i in pieces)) for pieces in per)
    return Schedule("produce", rank, world, steps, name="tail"), _TailPass(fn)


def _walk(group, ctx, *parts) -> None:
    """One executor walk over the merged (schedule, handler) pairs given (None entries skipped)."""
    parts = [p for p in parts if p is not None]
    if parts:
        execute(merge(*[s for s, _ in parts]), group, {h.tag: h for _, h in parts}, ctx)


def ar_matmul_forward(x, weight, group, ctx, algo, num_chunks, tail=None):
    """Dispatch to the plain function of `algo` (falls back to the reference, logged once, when the
    sequence does not divide by the group)."""
    rank, world = group_info(group)
    if tail is None and is_decode_shaped(x):  # x [1, b, k/P]: decode; "auto" = ours only where calibrated faster
        return all_reduce(F.linear(x, weight), group, algo="auto", context=ctx)
    if algo != "reference" and x.shape[0] % world:
        _log_once(("ar", x.shape[0], world), f"matmul_all_reduce: sequence length {x.shape[0]} is not "
                  f"divisible by the group size {world}; using the reference (GEMM + all_reduce)")
        algo = "reference"
    if algo == "reference":
        return ar_matmul_reference(x, weight, group, ctx, tail)
    if algo == "slicing":
        return ar_matmul_slicing(x, weight, group, ctx, num_chunks, tail)
    return ar_matmul_flash(x, weight, group, ctx, num_chunks, algo == "flash_bidir", tail)


def column_nosp_backward(dy, x, weight, group, ctx, algo, num_chunks, need_dw=True):
    """-> (dx [s, b, h] = AR(dy @ w), dw [n/P, h] = dy^T x or None); the wgrad fills the all-reduce tail."""
    dy = dy.contiguous()
    rank, world = group_info(group)
    dw = torch.zeros(weight.shape, dtype=acc_dtype(weight.dtype), device=weight.device) if need_dw else None
    spans = chunk_bounds(dy.shape[0], max(world - 1, 1))

    def piece(i):
        a, b = spans[i]
        dw.add_(_wgrad(dy[a:b], x[a:b]))

    dx = ar_matmul_forward(dy, weight.t(), group, ctx, algo, num_chunks, (len(spans), piece) if need_dw else None)
    return dx, (dw.to(weight.dtype) if need_dw else None)


# ---------------------------------------------------------------- autograd Functions

class MatmulAllReduce(torch.autograd.Function):
    """Row-parallel without SP: forward y = AR(x w^T); backward local (dy is replicated)."""

    @staticmethod
    def forward(ctx, x, weight, group, octx, algo, num_chunks):
        ctx.save_for_backward(x, weight)
        return ar_matmul_forward(x, weight, group, octx, algo, num_chunks)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dx = F.linear(dy, weight.t()) if ctx.needs_input_grad[0] else None
        dw = _wgrad(dy, x).to(weight.dtype) if ctx.needs_input_grad[1] else None
        return dx, dw, None, None, None, None


class MatmulAllReduceDgrad(torch.autograd.Function):
    """Column-parallel without SP: forward local y = x w^T + b; backward dx = AR(dy w), the dual."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, octx, algo, num_chunks):
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.octx, ctx.algo, ctx.num_chunks, ctx.has_bias = group, octx, algo, num_chunks, bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dx, dw = column_nosp_backward(dy, x, weight, ctx.group, ctx.octx, ctx.algo, ctx.num_chunks,
                                      need_dw=ctx.needs_input_grad[1])
        db = dy.sum(dim=tuple(range(dy.dim() - 1))) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, dw, db, None, None, None, None


# ---------------------------------------------------------------- public wrappers

def _resolve_chunks(op: str, algo: str, num_chunks: int | None) -> tuple[str, int]:
    """Like `algo.resolve`, but flash also takes `num_chunks` (sequence chunks, default DEFAULT_CHUNKS)."""
    algo_r, chunks = resolve(op, algo, num_chunks)
    if algo_r in ("flash", "flash_bidir"):
        if num_chunks is not None and int(num_chunks) < 1:
            raise ValueError(f"{op}: num_chunks must be >= 1 (e.g. num_chunks={DEFAULT_CHUNKS})")
        chunks = int(num_chunks or DEFAULT_CHUNKS)
    return algo_r, chunks


def matmul_all_reduce(x: torch.Tensor, weight: torch.Tensor, group=None, *, algo: str = "flash",
                      num_chunks: int | None = None, context: OverlapContext | None = None) -> torch.Tensor:
    """y [s, b, h] = AR(x [s, b, k/P] @ weight[h, k/P]^T), replicated, with autograd (row-parallel, no SP).

    num_chunks: sequence chunks C (flash: the exposed tail is 1/C of an all-gather; slicing: chunks)."""
    algo, chunks = _resolve_chunks("matmul_all_reduce", algo, num_chunks)
    ctx = checked_context("matmul_all_reduce", x, weight, None, group, context)
    if ctx is None:
        return F.linear(x, weight)
    return MatmulAllReduce.apply(x, weight, group, ctx, algo, chunks)


def matmul_allreduce_dgrad(x: torch.Tensor, weight: torch.Tensor, group=None, *, bias: torch.Tensor | None = None,
                           algo: str = "flash", num_chunks: int | None = None,
                           context: OverlapContext | None = None) -> torch.Tensor:
    """y [s, b, n/P] = x [s, b, h] @ weight[n/P, h]^T (+ bias), whose input gradient is all-reduced over
    `group` with the decomposed all-reduce (column-parallel, no SP: Megatron's `allreduce_dgrad`)."""
    algo, chunks = _resolve_chunks("matmul_allreduce_dgrad", algo, num_chunks)
    ctx = checked_context("matmul_allreduce_dgrad", x, weight, bias, group, context)
    if ctx is None:
        return F.linear(x, weight, bias)
    return MatmulAllReduceDgrad.apply(x, weight, bias, group, ctx, algo, chunks)
