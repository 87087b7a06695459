"""Shared numerics of every overlap operator: the accumulation and wire dtypes, the local partial GEMM and
the weight-gradient kernel.

    acc_dtype(dtype)           fp32 for bf16/fp16 (partial sums are KEPT in it), the input dtype otherwise
    wire_dtype(dtype, wire)    the dtype reduce-scatter partials TRAVEL in: wire="input" (the default) the
                               input dtype, stock's bytes; wire="fp32" acc_dtype(dtype), twice stock's bytes
    sums(dtype, device, wire)  the three as one runtime.options.Sums (acc, out = dtype, wire) for the pipeline
    partial_linear(x, w)       x [n, ..., k] @ w [h, k]^T -> [n, ..., h], the local partial of a reduce-scatter:
                               fp32 straight out of the GEMM for bf16/fp16 on CUDA (torch.mm(out_dtype=)),
                               the input dtype elsewhere (torch 2.13 has no CPU kernel for mm's out_dtype)
    wgrad(dy, x)               dy [r, b, n], x [r, b, h] -> dw [n, h] = dy^T x, in the accumulation dtype
    wgrad(dy, x, cols)         rows cols of dw only: dy[..., cols]^T x (the DP bucket takes dw row range by range)
    add_wgrad(into, dy, x)    into [n, h] += dy^T x in into's dtype, with no [n, h] temporary (the fused
                          accumulation into Megatron's fp32 `main_grad`, slice by slice)
    wgrad_target(weight, into, need)  the buffer a backward sums dw into: `into`, or fresh acc_dtype zeros
    wgrad_result(weight, target, into)  what the plain backward returns for dw: None when it went into `into`
    wgrad_by_rows(dy or x, ...)     part(span, rows): the wgrad of a row span, as wgrad computes it
    rows_writer(out, w, b)          write(span, x_rows): out[span] = x_rows @ w^T + b in place (GEMM slices)
    partial_producer(x, w)          the Flash-RS Producer of partials x[rows] @ w^T (in place where it can)

Reduce-scatter numerics, per hop of the ring: the received partial (wire dtype) is upcast-added to the
local partial in the fp32 accumulator; the sum is rounded to the wire dtype only to be sent on, and the own
block, which never leaves the rank, is rounded once to the input dtype at the end. With wire="input" a bf16
sum of P partials is rounded P-1 times (as stock's ring), with wire="fp32" once; each GEMM partial is already
rounded to bf16 on CPU before either, so the gain of fp32 on the wire is small (tests/gloo/test_wire_dtype.py
measures both against an fp64 reference and against stock's reduce-scatter).
Weight gradients summed across slices or blocks are summed in acc_dtype: the sum order differs from one
big GEMM, and bf16 partial sums would lose the low bits of every slice.

add_wgrad, bf16/fp16 operands into an fp32 buffer (the cheapest exact-enough way in torch 2.13):
    CUDA  torch.addmm(into, a, b, out_dtype=float32, out=into): cuBLAS reads bf16, multiplies and
          accumulates in fp32 and adds into `into` in place (beta = 1): no temporary at all.
    CPU   no out_dtype kernel exists (aten::addmm.dtype_out is CUDA-only), so the two slice operands are
          cast to fp32 (temporaries of r*(n+h) elements, the slice's own size, never n*h) and
          `into.addmm_` runs an fp32 GEMM (on CPUs without bf16 units it is no slower than a bf16 one).
Both are exact in the same sense: a product of two bf16 (8-bit significands) or fp16 (11-bit) values is
exact in fp32 (24-bit), so either way dw is the fp32 sum of exact products; only the sum order differs.
"""
from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from ..config.plan import WIRE_DTYPES, check_wire  # noqa: F401  (the wire words: config/plan.py)
from .options import Producer, Sums

_LOW = (torch.bfloat16, torch.float16)


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype partial sums are kept in: fp32 for bf16/fp16, the input dtype otherwise."""
    return torch.float32 if dtype in _LOW else dtype


def wire_dtype(dtype: torch.dtype, wire: str = "input") -> torch.dtype:
    """The dtype reduce-scatter partials of `dtype` inputs travel in: "input" -> dtype, "fp32" -> acc_dtype."""
    check_wire("wire_dtype", wire)
    return dtype if wire == "input" else acc_dtype(dtype)


@functools.lru_cache(maxsize=64)
def sums(dtype: torch.dtype, device, wire: str = "input") -> Sums:
    """How reduce-scatter partials of `dtype` inputs add up: kept in acc_dtype, sent in wire_dtype, out in dtype
    (made once per dtype, device and wire word: a per-call lookup)."""
    return Sums(acc_dtype(dtype), dtype, wire_dtype(dtype, wire), device)


def _gemm_writes_fp32(x: torch.Tensor) -> bool:
    """bf16/fp16 on CUDA: torch.mm(out_dtype=torch.float32) has a CUDA kernel in torch 2.13 (none on CPU)."""
    return x.is_cuda and x.dtype in _LOW


def partial_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [n, ..., k] @ w [h, k]^T -> [n, ..., h]: fp32 from bf16/fp16 on CUDA, else in x.dtype."""
    if not _gemm_writes_fp32(x):
        return F.linear(x, w)
    y = torch.mm(x.reshape(-1, x.shape[-1]), w.t(), out_dtype=torch.float32)  # [n*..., h]
    return y.view(tuple(x.shape[:-1]) + (w.shape[0],))


def flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])  # [s, b, c] -> [s*b, c]


def wgrad(dy: torch.Tensor, x: torch.Tensor, cols: slice | None = None) -> torch.Tensor:
    """dw [n, h] = dy^T x (or its rows `cols`: dy[..., cols]^T x), in acc_dtype(x.dtype)."""
    d = flat(dy) if cols is None else flat(dy)[:, cols]
    if _gemm_writes_fp32(x):
        return torch.mm(d.t(), flat(x), out_dtype=torch.float32)
    return torch.mm(d.t(), flat(x)).to(acc_dtype(x.dtype))


_HAS_OUT_DTYPE = "dtype_out" in torch.ops.aten.addmm.overloads()  # torch >= 2.8


def _out_dtype_gemm(a: torch.Tensor, into: torch.Tensor) -> bool:
    """bf16/fp16 operands into fp32 on CUDA: the out_dtype GEMM (module docstring). Basis: torch's
    _addmm_dtype_out_cuda accepts exactly fp16/bf16 -> fp32, and CPU has no kernel for it."""
    return (_HAS_OUT_DTYPE and a.is_cuda and into.dtype == torch.float32
            and a.dtype in (torch.bfloat16, torch.float16))


def add_wgrad(into: torch.Tensor, dy: torch.Tensor, x: torch.Tensor, cols: slice | None = None) -> None:
    """into [n, h] += dy^T x (or rows `cols`: dy[..., cols]^T x), summed in into.dtype, in place."""
    a, b = (flat(dy) if cols is None else flat(dy)[:, cols]).t(), flat(x)  # [n, r], [r, h]
    if a.dtype == into.dtype:
        into.addmm_(a, b)
    elif _out_dtype_gemm(a, into):
        torch.addmm(into, a, b, out_dtype=into.dtype, out=into)
    else:
        into.addmm_(a.to(into.dtype), b.to(into.dtype))  # slice-sized casts (module docstring)


def wgrad_target(weight: torch.Tensor, into: torch.Tensor | None, need_dw: bool = True) -> torch.Tensor | None:
    """The buffer a backward sums dw [n, h] into: the caller's `into` (e.g. main_grad), else fresh zeros
    in acc_dtype(weight.dtype); None when no weight gradient is wanted."""
    if not need_dw:
        return None
    return into if into is not None else zeros_acc(weight)


def wgrad_result(weight: torch.Tensor, target: torch.Tensor | None, into: torch.Tensor | None):
    """dw as the plain backward returns it: None when it was added into the caller's `into` (or not
    wanted), else the summed buffer rounded once to weight.dtype."""
    if target is None or into is not None:
        return None
    return target.to(weight.dtype)


def wgrad_by_rows(fixed: torch.Tensor, fixed_is_dy: bool):
    """-> part(span, rows): the wgrad of rows `span`, dy[span]^T rows (fixed = dy [s, b, n]) or rows^T x[span]
    (fixed = x [s, b, h]), computed as `wgrad` does (one mm, then acc_dtype); the flat view made once."""
    f2, per = flat(fixed), math.prod(fixed.shape[1:-1])  # [s * b, c], rows of f2 per row of s

    def part(span, rows: torch.Tensor) -> torch.Tensor:
        f = f2[span[0] * per:span[1] * per]
        d, x = (f, flat(rows)) if fixed_is_dy else (flat(rows), f)
        return torch.mm(d.t(), x).to(acc_dtype(x.dtype))
    return part


def zeros_acc(like: torch.Tensor) -> torch.Tensor:
    """An accumulator shaped like `like`, in its accumulation dtype (gradients summed over slices)."""
    return torch.zeros(like.shape, dtype=acc_dtype(like.dtype), device=like.device)


def rows_writer(out: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """-> write(span, x_rows): out[span] = x_rows [n, b, k] @ weight[m, k]^T (+ bias [m]) for out [s, b, m]
    (contiguous), in place: the kernel F.linear runs on the flattened rows (mm / addmm), no temporary."""
    per = math.prod(out.shape[1:-1])  # rows of the flattened [s * b, m] per row of s
    o2, wt = out.view(-1, out.shape[-1]), weight.t()  # [s * b, m], [k, m]

    def write(span, x_rows: torch.Tensor) -> None:
        x2 = x_rows.reshape(-1, x_rows.shape[-1])  # [n * b, k]
        if bias is None:
            torch.mm(x2, wt, out=o2[span[0] * per:span[1] * per])
        else:
            torch.addmm(bias, x2, wt, out=o2[span[0] * per:span[1] * per])
    return write


def partial_producer(x: torch.Tensor, weight: torch.Tensor, offset: int = 0) -> Producer:
    """The Flash-RS Producer of partials x[offset + rows] @ w^T for x [s, b, k]: `fn(span, out)` writes into the
    ring slot where partials keep the input dtype (into=True), else `fn(span)` returns it (the handler casts
    it into its fp32 slot)."""
    if acc_dtype(x.dtype) != x.dtype:  # bf16/fp16: fp32 straight from the GEMM where torch can (partial_linear)
        return Producer(lambda span: partial_linear(x[offset + span[0]:offset + span[1]], weight))
    per = math.prod(x.shape[1:-1])
    x2, wt = x.reshape(-1, x.shape[-1]), weight.t()  # [s * b, k], [k, m]

    def produce(span, out: torch.Tensor) -> None:
        torch.mm(x2[(offset + span[0]) * per:(offset + span[1]) * per], wt, out=out.view(-1, out.shape[-1]))
    return Producer(produce, into=True)
