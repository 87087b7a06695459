"""Worker-side body of the fair-baseline test: the GEMM kernels a slicing baseline runs, recorded below
autograd (TorchDispatchMode sees the aten ops the CPU actually executes).

A baseline is fair when its compute is the unsplit GEMM's, cut into pieces: every GEMM is a plain 2-D
mm/addmm on operands BLAS reads directly (each contiguous, or the transpose of a contiguous one), their
FLOPs add up to the unsplit GEMM's, and no copy moves more than the operator's input and output once.
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import megatron_flashoverlap  # noqa: F401  (registers every plain function)
from megatron_flashoverlap.ops.registry import OpPlan, plain
from megatron_flashoverlap.runtime.context import OverlapContext

GEMMS = {"mm", "addmm", "bmm", "baddbmm"}
COPIES = {"copy_", "clone", "_to_copy", "cat", "contiguous"}


def _blas_direct(t: torch.Tensor) -> bool:
    """A 2-D operand BLAS reads without a copy: row-major or column-major with a unit stride."""
    return t.dim() == 2 and (t.stride(1) == 1 or t.stride(0) == 1)


class Recorder(TorchDispatchMode):
    """Counts FLOPs of GEMMs, GEMMs on operands BLAS cannot read directly, batched GEMMs and copied elements."""

    def __init__(self):
        super().__init__()
        self.flops, self.strided, self.batched, self.copied = 0, 0, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in GEMMS:
            a, b = (args[1], args[2]) if name in ("addmm", "baddbmm") else (args[0], args[1])
            self.batched += name in ("bmm", "baddbmm")
            self.strided += not (_blas_direct(a) and _blas_direct(b)) if a.dim() == 2 else 0
            self.flops += 2 * a.numel() * b.shape[-1]
        elif name in COPIES:
            self.copied += sum(t.numel() for t in args if isinstance(t, torch.Tensor)) if name == "cat" else \
                args[0].numel()
        return func(*args, **(kwargs or {}))


def _inputs(op, s, b, k, n, world, strided):
    g = torch.Generator().manual_seed(0)
    rows = s // world if op == "all_gather_matmul" else s
    x = torch.randn(b, rows, k, generator=g).transpose(0, 1) if strided else torch.randn(rows, b, k, generator=g)
    w = torch.randn(n, k, generator=g) / k ** 0.5
    return x, w


def record(rank, world, op, s, b, k, n, num_chunks, strided=False):
    """Run `op`'s slicing baseline once under the recorder: x [s(/P), b, k], w [n, k] (x strided: a
    transposed [b, s, k] tensor). -> the counts."""
    x, w = _inputs(op, s, b, k, n, world, strided)
    ctx, fn, plan = OverlapContext(check_peers=False), plain(op, "slicing"), OpPlan("slicing", num_chunks=num_chunks)
    with torch.no_grad(), Recorder() as rec:
        if op == "all_gather_matmul":
            fn(x, w, None, None, ctx, plan)
        else:
            fn(x, w, None, ctx, plan)
    return {"flops": rec.flops, "strided": rec.strided, "batched": rec.batched, "copied": rec.copied}
