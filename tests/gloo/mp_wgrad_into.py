"""Worker bodies: the operators' `wgrad_into` (dW added into a caller's fp32 buffer) on gloo ranks.

Every rank builds the same global tensors from one seed and takes its shards. Each case runs the
operator twice on the same inputs: once plain (dw returned in weight.grad), once with wgrad_into = a
nonzero fp32 buffer (what earlier micro-batches left in main_grad). It returns the errors of the
buffer's increment against the float64 formula and against the plain run's dw, whether dx is bitwise
the same, and what autograd left on the weight (Megatron's dummy contract).
"""
from __future__ import annotations

import torch

import megatron_flashoverlap as fo
from megatron_flashoverlap.ops.tp_nosp.autograd import matmul_all_reduce, matmul_allreduce_dgrad

DT = {"float32": torch.float32, "bfloat16": torch.bfloat16}
S, B, H, N = 8, 3, 12, 8  # s, b, the replicated hidden size, the sharded size per rank


def _rand(g, *shape, dtype):
    return torch.randn(*shape, generator=g).to(dtype)


def _operands(op, rank, world, dtype, seed):
    """-> (run(x, w, into) -> y, x, w, dy, dw64): this rank's operands and the float64 dw formula."""
    g = torch.Generator().manual_seed(seed)
    s, rows = S * world, S
    if op == "all_gather_matmul":  # x_shard [s/P, b, h], w [n, h], dy [s, b, n]
        x_full, w = _rand(g, s, B, H, dtype=dtype), _rand(g, world, N, H, dtype=dtype)[rank]
        dy = _rand(g, world, s, B, N, dtype=dtype)[rank]
        x, wx = x_full[rank * rows:(rank + 1) * rows], x_full
        run = lambda x, w, into, algo, keep: fo.all_gather_matmul(x, w, plan=_plan(algo, 3, keep), wgrad=_into(into))
        return run, x, w, dy, _dw64(dy, wx)
    if op == "matmul_reduce_scatter":  # x [s, b, k/P], w [h, k/P], dy_s [s/P, b, h]
        x, w = _rand(g, world, s, B, N, dtype=dtype)[rank], _rand(g, world, H, N, dtype=dtype)[rank]
        dy_full = _rand(g, s, B, H, dtype=dtype)
        run = lambda x, w, into, algo, keep: fo.matmul_reduce_scatter(x, w, plan=_plan(algo, 3), wgrad=_into(into))
        return run, x, w, dy_full[rank * rows:(rank + 1) * rows], _dw64(dy_full, x)
    if op == "matmul_all_reduce":  # x [s, b, k/P], w [h, k/P], dy [s, b, h] replicated
        x, w = _rand(g, world, s, B, N, dtype=dtype)[rank], _rand(g, world, H, N, dtype=dtype)[rank]
        dy = _rand(g, s, B, H, dtype=dtype)
        run = lambda x, w, into, algo, keep: matmul_all_reduce(x, w, plan=_plan(algo, 2, rings=True), wgrad=_into(into))
        return run, x, w, dy, _dw64(dy, x)
    # matmul_allreduce_dgrad: x [s, b, h] replicated, w [n/P, h], dy [s, b, n/P]
    x, w = _rand(g, s, B, H, dtype=dtype), _rand(g, world, N, H, dtype=dtype)[rank]
    dy = _rand(g, world, s, B, N, dtype=dtype)[rank]
    run = lambda x, w, into, algo, keep: matmul_allreduce_dgrad(x, w, plan=_plan(algo, 2, rings=True),
                                                                wgrad=_into(into))
    return run, x, w, dy, _dw64(dy, x)


def _plan(algo, chunks, keep=False, rings=False):
    """The case's OpPlan: `chunks` for slicing (and for the rings of the all-reduce operators: rings=True)."""
    chunked = algo == "slicing" or (rings and algo != "reference")
    return fo.OpPlan(algo, num_chunks=chunks if chunked else None, keep_gathered=keep)


def _into(buf):
    return None if buf is None else fo.WgradRoute(into=buf)


def _dw64(dy, x):
    return dy.double().reshape(-1, dy.shape[-1]).t() @ x.double().reshape(-1, x.shape[-1])


def _once(run, x, w, dy, into, algo, keep, flags):
    """One forward + backward on fresh leaves; -> (dx, the weight leaf)."""
    xl, wl = x.clone().requires_grad_(), torch.nn.Parameter(w.clone())
    for k, v in flags.items():
        setattr(wl, k, v)
    run(xl, wl, into, algo, keep).backward(dy)
    return xl.grad, wl


def _rel(a, b, scale):
    return (a.double() - b.double()).abs().max().item() / scale


def case(rank, world, op, algo, dtype="float32", keep=False, flags=None, seed=0):
    """-> errors of the accumulated dw and what the weight got back (see the module docstring)."""
    flags = dict(flags or {})
    run, x, w, dy, dw64 = _operands(op, rank, world, DT[dtype], seed)
    base = torch.randn(w.shape, generator=torch.Generator().manual_seed(seed + 99))  # earlier micro-batches
    into = base.clone()
    dx_plain, w_plain = _once(run, x, w, dy, None, algo, keep, {})
    dx_into, w_into = _once(run, x, w, dy, into, algo, keep, flags)
    scale = dw64.abs().max().item()
    grad = w_into.grad
    return {"err_vs_float64": _rel(into.double() - base.double(), dw64, scale),
            "err_vs_plain": _rel(into - base, w_plain.grad.float(), scale),
            "dx_equal": torch.equal(dx_plain, dx_into),
            "grad": None if grad is None else (tuple(grad.shape), str(grad.dtype), bool(grad.eq(0).all())),
            "flag": getattr(w_into, "grad_added_to_main_grad", None), "shape": tuple(w.shape)}


def size_one_group(rank, world, dtype="float32"):
    """A group of one rank (no communication): wgrad_into still receives dW; -> its error vs float64."""
    import torch.distributed as dist

    groups = [dist.new_group([r]) for r in range(world)]  # every rank creates every group
    g = torch.Generator().manual_seed(5)
    x, w, dy = (_rand(g, S, B, H, dtype=DT[dtype]), _rand(g, N, H, dtype=DT[dtype]), _rand(g, S, B, N, dtype=DT[dtype]))
    into = torch.zeros(N, H)
    wl = torch.nn.Parameter(w.clone())
    wl.grad_added_to_main_grad = False
    fo.all_gather_matmul(x, wl, groups[rank], wgrad=fo.WgradRoute(into=into)).backward(dy)
    dw64 = _dw64(dy, x)
    return {"err": _rel(into, dw64, dw64.abs().max().item()), "flag": wl.grad_added_to_main_grad,
            "grad_shape": tuple(wl.grad.shape)}


def bad_into(rank, world):
    """A wgrad_into of the wrong shape -> the ValueError text (before any transfer)."""
    x, w = torch.randn(S, B, H), torch.nn.Parameter(torch.randn(N, H))
    try:
        fo.all_gather_matmul(x, w, wgrad=fo.WgradRoute(into=torch.zeros(H, N)))
    except ValueError as err:
        return str(err)
    return None
