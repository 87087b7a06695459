"""Shared numerics of every overlap operator: the accumulation dtype and the weight-gradient kernel.

    acc_dtype(dtype)      fp32 for bf16/fp16 (partial sums are kept AND sent in it), the input dtype otherwise
    wgrad(dy, x)          dy [r, b, n], x [r, b, h] -> dw [n, h] = dy^T x, in the accumulation dtype
    wgrad(dy, x, cols)    rows cols of dw only: dy[..., cols]^T x (the DP bucket takes dw row range by range)
    add_wgrad(into, dy, x)    into [n, h] += dy^T x in into's dtype, with no [n, h] temporary (the fused
                          accumulation into Megatron's fp32 `main_grad`, slice by slice)
    wgrad_target(weight, into, need)  the buffer a backward sums dw into: `into`, or fresh acc_dtype zeros
    wgrad_result(weight, target, into)  what the plain backward returns for dw: None when it went into `into`

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


_HAS_OUT_DTYPE = "dtype_out" in torch.ops.aten.addmm.overloads()  # torch >= 2.8


def _should_use_out_dtype(a: torch.Tensor, into: torch.Tensor) -> bool:
    """bf16/fp16 operands into fp32 on CUDA: the out_dtype GEMM (module docstring). Basis: torch's
    _addmm_dtype_out_cuda accepts exactly fp16/bf16 -> fp32, and CPU has no kernel for it."""
    return (_HAS_OUT_DTYPE and a.is_cuda and into.dtype == torch.float32
            and a.dtype in (torch.bfloat16, torch.float16))


def add_wgrad(into: torch.Tensor, dy: torch.Tensor, x: torch.Tensor, cols: slice | None = None) -> None:
    """into [n, h] += dy^T x (or rows `cols`: dy[..., cols]^T x), summed in into.dtype, in place."""
    a, b = (flat(dy) if cols is None else flat(dy)[:, cols]).t(), flat(x)  # [n, r], [r, h]
    if a.dtype == into.dtype:
        into.addmm_(a, b)
    elif _should_use_out_dtype(a, into):
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


def zeros_acc(like: torch.Tensor) -> torch.Tensor:
    """An accumulator shaped like `like`, in its accumulation dtype (gradients summed over slices)."""
    return torch.zeros(like.shape, dtype=acc_dtype(like.dtype), device=like.device)
