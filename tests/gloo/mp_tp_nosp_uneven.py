"""Worker bodies: the row-parallel all-reduce (no SP) at sequence lengths P does not divide (prefill of any
prompt length). Every rank builds the same global tensors from one seed; assertions live in the test file."""
from __future__ import annotations

import torch

from megatron_flashoverlap.ops import OpPlan
from megatron_flashoverlap.ops.tp_nosp import autograd as arm
from megatron_flashoverlap.runtime import OverlapContext

DT = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _err(a, b):
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def row(rank, world, algo, s, b, k, h, dtype="float32", seed=0):
    """y = AR(x_k w_k^T) at any s: ours (traced: did the decomposed walk run?) against the reference and a
    float64 dense formula; backward dx, dw."""
    dt = DT[dtype]
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(s, b, k, generator=g).to(dt), (torch.randn(h, k, generator=g) / k ** 0.5).to(dt)
    dy = torch.randn(s, b, h, generator=g).to(dt)
    kl = k // world
    xs = x[:, :, rank * kl:(rank + 1) * kl].clone().requires_grad_()
    ws = w[:, rank * kl:(rank + 1) * kl].clone().requires_grad_()
    ctx = OverlapContext(check_peers=False, trace=[])
    y = arm.matmul_all_reduce(xs, ws, plan=OpPlan(algo, num_chunks=2, decode_all_reduce=None), context=ctx)
    y.backward(dy)
    with torch.no_grad():
        y_ref = arm.matmul_all_reduce(xs, ws, algo="reference")
    xd, wd, dyd = x.double(), w.double(), dy.double()
    return {"walked": bool(ctx.trace), "shape": tuple(y.shape), "y_vs_ref": _err(y, y_ref),
            "y": _err(y, xd @ wd.t()), "scale": (xd @ wd.t()).abs().max().item(), "y_out": y.detach(),
            "dx": _err(xs.grad, (dyd @ wd)[:, :, rank * kl:(rank + 1) * kl]),
            "dw": _err(ws.grad, dyd.reshape(-1, h).t() @ xd.reshape(-1, k)[:, rank * kl:(rank + 1) * kl])}


def column(rank, world, algo, s, b, h, n, seed=0):
    """Column-parallel dgrad dx = AR(dy_n w_n) at any s: ours (traced) against the float64 formula."""
    g = torch.Generator().manual_seed(seed)
    x, w, dy = torch.randn(s, b, h, generator=g), torch.randn(n, h, generator=g) / h ** 0.5, torch.randn(s, b, n,
                                                                                                      generator=g)
    nl = n // world
    xs = x.clone().requires_grad_()
    ws = w[rank * nl:(rank + 1) * nl].clone().requires_grad_()
    ctx = OverlapContext(check_peers=False, trace=[])
    y = arm.matmul_allreduce_dgrad(xs, ws, plan=OpPlan(algo), context=ctx)
    walked_forward = bool(ctx.trace)  # the forward is local: no walk
    y.backward(dy[:, :, rank * nl:(rank + 1) * nl])
    dyd = dy.double()
    return {"walked_forward": walked_forward, "walked": bool(ctx.trace), "dx": _err(xs.grad, dyd @ w.double()),
            "scale": (dyd @ w.double()).abs().max().item(), "dx_out": xs.grad.detach(),
            "dw": _err(ws.grad, dyd[:, :, rank * nl:(rank + 1) * nl].reshape(-1, nl).t() @ x.double().reshape(-1, h))}
