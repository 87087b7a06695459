"""Shared numerics of every overlap operator: the accumulation dtype and the weight-gradient kernel.

    acc_dtype(dtype)      fp32 for bf16/fp16 (partial sums are kept AND sent in it), the input dtype otherwise
    wgrad(dy, x)          dy [r, b, n], x [r, b, h] -> dw [n, h] = dy^T x, in the accumulation dtype
    wgrad(dy, x, cols)    rows cols of dw only: dy[..., cols]^T x (the DP bucket takes dw row range by range)

Weight gradients summed across slices or blocks are summed in acc_dtype: the sum order differs from one
big GEMM, and bf16 partial sums would lose the low bits of every slice.
"""
from __future__ import annotations

import torch


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype partial sums are kept and sent in: fp32 for bf16/fp16, the input dtype otherwise."""
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


def flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])  # [s, b, c] -> [s*b, c]


def wgrad(dy: torch.Tensor, x: torch.Tensor, cols: slice | None = None) -> torch.Tensor:
    """dw [n, h] = dy^T x (or its rows `cols`: dy[..., cols]^T x), in acc_dtype(x.dtype)."""
    d = flat(dy) if cols is None else flat(dy)[:, cols]
    return torch.mm(d.t(), flat(x)).to(acc_dtype(x.dtype))


def zeros_acc(like: torch.Tensor) -> torch.Tensor:
    """An accumulator shaped like `like`, in its accumulation dtype (gradients summed over slices)."""
    return torch.zeros(like.shape, dtype=acc_dtype(like.dtype), device=like.device)
