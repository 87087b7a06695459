"""Shared numerics of every overlap operator: the accumulation dtype and the weight-gradient kernel.

    acc_dtype(dtype)      fp32 for bf16/fp16 (partial sums are kept AND sent in it), the input dtype otherwise
    wgrad(dy, x)          dy [r, b, n], x [r, b, h] -> dw [n, h] = dy^T x, in the accumulation dtype
    wgrad(dy, x, cols)    rows cols of dw only: dy[..., cols]^T x (the DP bucket takes dw row range by range)
    wgrad_by_rows(dy or x, ...)     part(span, rows): the wgrad of a row span, as wgrad computes it
    rows_writer(out, w, b)          write(span, x_rows): out[span] = x_rows @ w^T + b in place (GEMM slices)
    partial_producer(x, w)          the Flash-RS producer of partials x[rows] @ w^T (in place where it can)

Weight gradients summed across slices or blocks are summed in acc_dtype: the sum order differs from one
big GEMM, and bf16 partial sums would lose the low bits of every slice.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype partial sums are kept and sent in: fp32 for bf16/fp16, the input dtype otherwise."""
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


def flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])  # [s, b, c] -> [s*b, c]


def wgrad(dy: torch.Tensor, x: torch.Tensor, cols: slice | None = None) -> torch.Tensor:
    """dw [n, h] = dy^T x (or its rows `cols`: dy[..., cols]^T x), in acc_dtype(x.dtype)."""
    d = flat(dy) if cols is None else flat(dy)[:, cols]
    return torch.mm(d.t(), flat(x)).to(acc_dtype(x.dtype))


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


def partial_producer(x: torch.Tensor, weight: torch.Tensor, offset: int = 0):
    """The Flash-RS producer of partials x[offset + rows] @ w^T for x [s, b, k] and whether it writes into the
    ring slot: `produce(span, out)` in place where partials keep the input dtype, else `produce(span)` returns
    it (the handler casts it into its fp32 slot)."""
    if acc_dtype(x.dtype) != x.dtype:
        return (lambda span: F.linear(x[offset + span[0]:offset + span[1]], weight)), False
    per = math.prod(x.shape[1:-1])
    x2, wt = x.reshape(-1, x.shape[-1]), weight.t()  # [s * b, k], [k, m]

    def produce(span, out: torch.Tensor) -> None:
        torch.mm(x2[(offset + span[0]) * per:(offset + span[1]) * per], wt, out=out.view(-1, out.shape[-1]))
    return produce, True
