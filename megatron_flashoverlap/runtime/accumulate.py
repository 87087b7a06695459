"""Weight gradients added into a caller's buffer: Megatron's gradient_accumulation_fusion, in pure torch.

    wgrad_into [n, h]    the buffer dW is added into (in Megatron: the fp32 `weight.main_grad` view that its
                         DistributedDataParallel allocates); each operator's backward adds slice by slice
                         (runtime.numerics.add_wgrad), so dW never exists as a whole tensor
    check_wgrad_into(op, weight, into)   shape / device / dtype, a ValueError naming the fix
    weight_grad(weight, into, dtype)     what autograd gets for `weight` once dW went into `into`
    linear_into(x, weight, bias, into)   a group of size 1: y = x w^T + b, dW into `into` (no communication)

Megatron-Core's contract (tensor_parallel/layers.py, LinearWithGradAccumulationAndAsyncCommunication.backward;
read in 0.16.1 and 0.19.2), which weight_grad follows (its no-Transformer-Engine branch):
  the weight has `grad_added_to_main_grad` (DDP puts it on every trainable parameter): set it True and
      return a dummy of main_grad's shape in the INPUT dtype: zeros when `weight.zero_out_wgrad` (DDP's
      post hook adds such a grad into main_grad: zeros add nothing), torch.empty otherwise (the hook skips
      a grad once the flag is set). The dummy makes autograd run the parameter's AccumulateGrad node, so
      DDP's post hook fires (grad-ready bookkeeping under overlap_grad_reduce, which asserts a grad) and
      then clears `.grad`.
  no such attribute: None (nothing is left to accumulate into `.grad`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .numerics import add_wgrad

_FLOATS = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def check_wgrad_into(op: str, weight: torch.Tensor, into: torch.Tensor | None, fn=None) -> None:
    """`into` must be a floating tensor of weight's shape on weight's device (None: nothing to check);
    `fn` (wgrad_fn: the caller takes the complete dW operands) excludes it and must be callable."""
    if fn is not None and (into is not None or not callable(fn)):
        raise ValueError(f"{op}: pass either wgrad_into (dW added into a buffer) or a callable wgrad_fn (dW "
                         f"operands handed to the caller), not both")
    if into is None:
        return
    if not isinstance(into, torch.Tensor) or tuple(into.shape) != tuple(weight.shape):
        got = tuple(into.shape) if isinstance(into, torch.Tensor) else type(into).__name__
        raise ValueError(f"{op}: wgrad_into must be a tensor shaped like the weight {tuple(weight.shape)} "
                         f"(e.g. weight.main_grad); got {got}")
    if into.device != weight.device or into.dtype not in _FLOATS:
        raise ValueError(f"{op}: wgrad_into is {into.dtype} on {into.device}; it must be a floating tensor on "
                         f"the weight's device {weight.device} (Megatron's main_grad is fp32 there)")
    if into.requires_grad:
        raise ValueError(f"{op}: wgrad_into requires grad; pass a plain buffer (e.g. weight.main_grad)")


def weight_grad(weight: torch.Tensor, into: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """The gradient autograd gets for `weight` after dW was added into `into` (module docstring)."""
    if not hasattr(weight, "grad_added_to_main_grad"):
        return None
    make = torch.zeros if getattr(weight, "zero_out_wgrad", False) else torch.empty
    dummy = make(into.shape, dtype=dtype, device=into.device, requires_grad=False)
    weight.grad_added_to_main_grad = True
    return dummy


class LinearInto(torch.autograd.Function):
    """y [.., n] = x [.., h] @ w [n, h]^T (+ b); backward dx = dy @ w, dW added into `into`, db = sum dy."""

    @staticmethod
    def forward(ctx, x, weight, bias, into, fn=None):
        ctx.save_for_backward(x, weight)
        ctx.into, ctx.has_bias, ctx.fn = into, bias is not None, fn
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dx = F.linear(dy, weight.t()) if ctx.needs_input_grad[0] else None
        dw = None
        if ctx.needs_input_grad[1] and ctx.fn is not None:
            dw = ctx.fn(dy, x)
        elif ctx.needs_input_grad[1]:
            add_wgrad(ctx.into, dy, x)
            dw = weight_grad(weight, ctx.into, x.dtype)
        db = dy.sum(dim=tuple(range(dy.dim() - 1))) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, dw, db, None, None


def linear_into(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                into: torch.Tensor | None, fn=None) -> torch.Tensor:
    """The size-1-group path of every operator: F.linear, with dW into `into` (or to `fn`) when given."""
    if into is None and fn is None:
        return F.linear(x, weight, bias)
    return LinearInto.apply(x, weight, bias, into, fn)
