"""Worker bodies: tensor parallel without sequence parallel (all-reduce) operators on gloo ranks.

Every rank builds the same global tensors from one seed, takes its shards, runs the operator and its
reference, and returns errors against a float64 dense formula (assertions live in test_tp_nosp.py).
"""
from __future__ import annotations

import torch

from megatron_flashoverlap.ops import OpPlan
from megatron_flashoverlap.ops.tp_nosp import autograd as arm

DT = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _err(a, b):
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def _globals(seed, s, b, k, h, dtype):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(s, b, k, generator=g).to(dtype)
    w = torch.randn(h, k, generator=g).to(dtype) / k ** 0.5
    dy = torch.randn(s, b, h, generator=g).to(dtype)
    bias = torch.randn(k, generator=g).to(dtype)
    return x, w, dy, bias


def row(rank, world, algo, s, b, k, h, dtype="float32", seed=0, num_chunks=None):
    """Row-parallel: W [h, k] split by columns; y = AR(x_k w_k^T) replicated; backward local."""
    x, w, dy, _ = _globals(seed, s, b, k, h, DT[dtype])
    kl = k // world
    xs = x[:, :, rank * kl:(rank + 1) * kl].clone().requires_grad_()
    ws = w[:, rank * kl:(rank + 1) * kl].clone().requires_grad_()
    y = arm.matmul_all_reduce(xs, ws, plan=OpPlan(algo, num_chunks=num_chunks))
    y.backward(dy)
    with torch.no_grad():
        y_ref = arm.matmul_all_reduce(xs, ws, algo="reference")
    xd, wd, dyd = x.double(), w.double(), dy.double()
    return {"y": _err(y, xd @ wd.t()), "y_vs_ref": _err(y, y_ref), "scale": (xd @ wd.t()).abs().max().item(),
            "dx": _err(xs.grad, (dyd @ wd)[:, :, rank * kl:(rank + 1) * kl]),
            "dw": _err(ws.grad, dyd.reshape(-1, h).t() @ xd.reshape(-1, k)[:, rank * kl:(rank + 1) * kl]),
            "y_out": y.detach(), "dtype_ok": y.dtype == DT[dtype]}


def column(rank, world, algo, s, b, h, n, dtype="float32", seed=0, num_chunks=None):
    """Column-parallel: W [n, h] split by rows; y local; dx = AR(dy_n w_n) replicated."""
    x, w, dy, bias = _globals(seed, s, b, h, n, DT[dtype])  # here "k" = h and "h" = n
    w = w.reshape(n, h)
    nl = n // world
    xs = x.clone().requires_grad_()
    ws = w[rank * nl:(rank + 1) * nl].clone().requires_grad_()
    g = torch.Generator().manual_seed(seed + 1)
    bs = torch.randn(nl * world, generator=g).to(DT[dtype])[rank * nl:(rank + 1) * nl].clone().requires_grad_()
    y = arm.matmul_allreduce_dgrad(xs, ws, bias=bs, plan=OpPlan(algo, num_chunks=num_chunks))
    dys = dy[:, :, rank * nl:(rank + 1) * nl]
    y.backward(dys)
    xd, wd, dyd = x.double(), w.double(), dy.double()
    return {"y": _err(y, xd @ wd[rank * nl:(rank + 1) * nl].t() + bs.detach().double()),
            "dx": _err(xs.grad, dyd @ wd), "scale": (dyd @ wd).abs().max().item(),
            "dw": _err(ws.grad, dys.double().reshape(-1, nl).t() @ xd.reshape(-1, h)),
            "db": _err(bs.grad, dys.double().sum((0, 1))), "dx_out": xs.grad.detach()}
