"""Tensor parallel WITHOUT sequence parallel: the autograd.Functions and the public wrappers.

    matmul_all_reduce(x_k [s, b, k/P], weight_k [h, k/P], group) -> y [s, b, h]  (row-parallel, replicated)
        forward y = AR(x @ w^T)         backward dx = dy @ w, dw = dy^T x (local: dy is replicated)
    matmul_allreduce_dgrad(x [s, b, h], weight_n [n/P, h], group, bias) -> y_n [s, b, n/P]  (column-parallel)
        forward y = x @ w^T + bias      backward dx = AR(dy @ w) with the wgrad filling its tail, dw, db

The decomposition and the plain functions: ar_matmul.py. Decode (x [1, b, k/P], one new token per
sequence): a single row cannot be cut in rank blocks, so `matmul_all_reduce` runs the whole GEMM and
then `all_reduce(algo=decode_all_reduce)` ("auto": ours only where the calibration measured it faster,
else stock). That choice is explicit: `decode_all_reduce=None` runs `algo` for decode inputs too, and
algo="reference" or `force_reference()` run the reference (GEMM, then dist.all_reduce) whatever the shape.
Sequence not divisible by P (and not decode): one log line, then the reference.
wgrad_into [weight's shape] (optional, e.g. Megatron's fp32 main_grad): dw is added into it (slice by slice
in the column backward's all-reduce tail) instead of being returned; the weight then gets Megatron's dummy
gradient (runtime/accumulate.py: weight_grad). wgrad_fn(dy, x) -> the weight's autograd gradient (instead of
wgrad_into; e.g. the data-parallel reduce-scatter of dW, megatron/ddp.py): gets this rank's complete dW
operands once, after the all-reduce (its GEMM then runs inside the DP ring, not in the AR tail).
wire_dtype: what the all-reduce's reduce-scatter partials travel in, "input" (default, stock's bytes) or
"fp32" (ar_matmul.py); the decode all-reduce always runs in the input dtype.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from ...runtime import OverlapContext, group_info, wgrad
from ...runtime.handlers import chunk_bounds
from ...runtime.numerics import add_wgrad, wgrad_result, wgrad_target
from ...runtime.accumulate import linear_into, weight_grad
from ..all_reduce.all_reduce import all_reduce
from ..all_reduce.select import is_decode_shaped
from ..checks import checked_context
from ..registry import check_algo, plain, resolve
from .ar_matmul import DEFAULT_CHUNKS, OP

log = logging.getLogger(__name__)
_LOGGED: set = set()


def _log_once(key, msg: str) -> None:
    if key not in _LOGGED:
        _LOGGED.add(key)
        log.warning(msg)


def _should_use_decode_all_reduce(x, algo: str, decode_all_reduce: str | None) -> bool:
    """Decode-shaped x [1, b, k/P] under a fused algo, unless the caller turned the choice off.
    Basis: one row has no rank blocks to decompose; all_reduce("auto") follows the measured table."""
    return decode_all_reduce is not None and algo != "reference" and is_decode_shaped(x)


def ar_matmul_forward(x, weight, group, ctx, algo, num_chunks, tail=None, wire="input"):
    """The plain function of `algo` (the reference, logged once, where the sequence does not divide)."""
    world = group_info(group)[1]
    if x.shape[0] % world and algo != "reference":
        _log_once(("ar", x.shape[0], world), f"matmul_all_reduce: sequence length {x.shape[0]} is not "
                  f"divisible by the group size {world}; using the reference (GEMM + all_reduce)")
        algo = "reference"
    return plain(OP, algo)(x, weight, group, ctx, num_chunks=num_chunks, tail=tail, wire=wire)


def column_nosp_backward(dy, x, weight, group, ctx, algo, num_chunks, need_dw=True, wgrad_into=None,
                         wire="input", wgrad_fn=None):
    """-> (dx [s, b, h] = AR(dy @ w), dw [n/P, h] = dy^T x, or None when not wanted or added into
    wgrad_into); the wgrad fills the all-reduce tail (with wgrad_fn: dw = wgrad_fn(dy, x) after it)."""
    dy = dy.contiguous()
    if wgrad_fn is not None and need_dw:
        return ar_matmul_forward(dy, weight.t(), group, ctx, algo, num_chunks, None, wire), wgrad_fn(dy, x)
    world = group_info(group)[1]
    dw = wgrad_target(weight, wgrad_into, need_dw)
    spans = chunk_bounds(dy.shape[0], max(world - 1, 1))

    def piece(i):
        a, b = spans[i]
        add_wgrad(dw, dy[a:b], x[a:b])

    dx = ar_matmul_forward(dy, weight.t(), group, ctx, algo, num_chunks, (len(spans), piece) if need_dw else None,
                           wire)
    return dx, wgrad_result(weight, dw, wgrad_into)


def _weight_grad(weight, dw, into, need_dw, dtype):
    """The weight's autograd gradient: dw, or Megatron's dummy once dw went into `into`."""
    return weight_grad(weight, into, dtype) if need_dw and into is not None else dw


def _local_wgrad(dy, x, weight, into):
    """The row backward's local dw = dy^T x (dy is replicated): returned, or added into `into`."""
    if into is None:
        return wgrad(dy, x).to(weight.dtype)
    add_wgrad(into, dy, x)
    return None


class MatmulAllReduce(torch.autograd.Function):
    """Row-parallel without SP: forward y = AR(x w^T); backward local (dy is replicated)."""

    @staticmethod
    def forward(ctx, x, weight, group, octx, algo, num_chunks, decode_all_reduce, wire, wgrad_into, wgrad_fn):
        ctx.save_for_backward(x, weight)
        ctx.wgrad_into, ctx.wgrad_fn = wgrad_into, wgrad_fn
        if _should_use_decode_all_reduce(x, algo, decode_all_reduce):
            return all_reduce(F.linear(x, weight), group, algo=decode_all_reduce, context=octx)
        return ar_matmul_forward(x, weight, group, octx, algo, num_chunks, wire=wire)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        need_dw, into = ctx.needs_input_grad[1], ctx.wgrad_into
        dx = F.linear(dy, weight.t()) if ctx.needs_input_grad[0] else None
        if need_dw and ctx.wgrad_fn is not None:
            return (dx, ctx.wgrad_fn(dy, x)) + (None,) * 8
        dw = _local_wgrad(dy, x, weight, into) if need_dw else None
        return dx, _weight_grad(weight, dw, into, need_dw, x.dtype), None, None, None, None, None, None, None, None


class MatmulAllReduceDgrad(torch.autograd.Function):
    """Column-parallel without SP: forward local y = x w^T + b; backward dx = AR(dy w), the dual."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, octx, algo, num_chunks, wire, wgrad_into, wgrad_fn):
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.octx, ctx.algo, ctx.num_chunks, ctx.has_bias = group, octx, algo, num_chunks, bias is not None
        ctx.wgrad_into, ctx.wgrad_fn = wgrad_into, wgrad_fn
        ctx.wire = wire
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        need_dw, into = ctx.needs_input_grad[1], ctx.wgrad_into
        dx, dw = column_nosp_backward(dy, x, weight, ctx.group, ctx.octx, ctx.algo, ctx.num_chunks,
                                      need_dw=need_dw, wgrad_into=into, wire=ctx.wire, wgrad_fn=ctx.wgrad_fn)
        db = dy.sum(dim=tuple(range(dy.dim() - 1))) if ctx.has_bias and ctx.needs_input_grad[2] else None
        if ctx.wgrad_fn is None:
            dw = _weight_grad(weight, dw, into, need_dw, x.dtype)
        return dx, dw, db, None, None, None, None, None, None, None


def matmul_all_reduce(x: torch.Tensor, weight: torch.Tensor, group=None, *, algo: str = "flash",
                      num_chunks: int | None = None, decode_all_reduce: str | None = "auto",
                      wire_dtype: str = "input", context: OverlapContext | None = None,
                      wgrad_into: torch.Tensor | None = None, wgrad_fn=None) -> torch.Tensor:
    """y [s, b, h] = AR(x [s, b, k/P] @ weight[h, k/P]^T), replicated, with autograd (row-parallel, no SP).

    num_chunks: sequence chunks C (flash: the exposed tail is 1/C of an all-gather; slicing: chunks).
    decode_all_reduce: the all_reduce algo for decode-shaped x [1, b, k/P] (module docstring); None = off.
    wgrad_into [h, k/P]: dw is added into it (module docstring)."""
    algo, chunks = resolve("matmul_all_reduce", algo, num_chunks, default_chunks=DEFAULT_CHUNKS)
    if decode_all_reduce is not None:
        check_algo("all_reduce", decode_all_reduce)
    ctx = checked_context("matmul_all_reduce", x, weight, None, group, context,
                          wire_dtype=wire_dtype, wgrad_into=wgrad_into, wgrad_fn=wgrad_fn)
    if ctx is None:
        return linear_into(x, weight, None, wgrad_into, wgrad_fn)
    return MatmulAllReduce.apply(x, weight, group, ctx, algo, chunks, decode_all_reduce, wire_dtype, wgrad_into,
                                 wgrad_fn)


def matmul_allreduce_dgrad(x: torch.Tensor, weight: torch.Tensor, group=None, *, bias: torch.Tensor | None = None,
                           algo: str = "flash", num_chunks: int | None = None, wire_dtype: str = "input",
                           context: OverlapContext | None = None,
                           wgrad_into: torch.Tensor | None = None, wgrad_fn=None) -> torch.Tensor:
    """y [s, b, n/P] = x [s, b, h] @ weight[n/P, h]^T (+ bias), whose input gradient is all-reduced over
    `group` with the decomposed all-reduce (column-parallel, no SP: Megatron's `allreduce_dgrad`).
    wgrad_into [n/P, h]: dw is added into it (module docstring)."""
    algo, chunks = resolve("matmul_allreduce_dgrad", algo, num_chunks, default_chunks=DEFAULT_CHUNKS)
    ctx = checked_context("matmul_allreduce_dgrad", x, weight, bias, group, context,
                          wire_dtype=wire_dtype, wgrad_into=wgrad_into, wgrad_fn=wgrad_fn)
    if ctx is None:
        return linear_into(x, weight, bias, wgrad_into, wgrad_fn)
    return MatmulAllReduceDgrad.apply(x, weight, bias, group, ctx, algo, chunks, wire_dtype, wgrad_into, wgrad_fn)
