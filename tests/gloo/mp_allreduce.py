"""Worker-side bodies of the all-reduce numerics tests (run on every rank by the gloo pool).

Rank r's contribution is drawn from seed + r, so every rank can also build every other rank's tensor and
the exact float64 sum. Each case returns ratios err / bound, where bound = (P-1) * u * sum_r |x_r|
elementwise (the rounding bound of P-1 additions in the working dtype, u its unit roundoff), so a
correct all-reduce in any summation order gives a ratio <= 1.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

import megatron_flashoverlap as fo
from megatron_flashoverlap.runtime import OverlapContext

DT = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
UNIT_ROUNDOFF = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}


def _contribution(seed: int, r: int, numel: int, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1000 + r)
    return torch.randn(numel, generator=g).to(dtype)


def _ratio(out, exact, bound) -> float:
    return ((out.double() - exact).abs() / bound).max().item() if out.numel() else 0.0


def _case(rank, world, algo, numel, dt, local_world_size, seed, ctx):
    xs = [_contribution(seed, q, numel, dt) for q in range(world)]
    exact = torch.stack([x.double() for x in xs]).sum(0)
    bound = max(world - 1, 1) * UNIT_ROUNDOFF[dt] * torch.stack([x.double().abs() for x in xs]).sum(0) + 1e-300
    mine = xs[rank].clone()
    out = fo.all_reduce(mine, algo=algo, local_world_size=local_world_size, context=ctx)
    stock = xs[rank].clone()
    dist.all_reduce(stock)
    first = out.clone()
    dist.broadcast(first, 0)  # rank 0's result: every rank must hold the same bits
    return {"algo": algo, "numel": numel, "ours": _ratio(out, exact, bound), "stock": _ratio(stock, exact, bound),
            "vs_stock": _ratio(out, stock.double(), 2 * bound), "unchanged": bool(torch.equal(mine, xs[rank])),
            "replicated": bool(torch.equal(out, first)), "shape": tuple(out.shape) == (numel,),
            "dtype": out.dtype == dt}


def sweep(rank, world, algos, sizes, dtype="float32", local_world_size=None, seed=0):
    """Every (algo, size) case; returns the list of per-case dicts."""
    ctx = OverlapContext(check_peers=True)
    return [_case(rank, world, a, n, DT[dtype], local_world_size, seed, ctx) for a in algos for n in sizes]


def shaped(rank, world, algo, shape, local_world_size=None):
    """A [s, b, h] tensor keeps its shape; the result equals stock within the bound of `_case`."""
    x = _contribution(7, rank, int(torch.tensor(shape).prod()), torch.float32).view(shape)
    out = fo.all_reduce(x, algo=algo, local_world_size=local_world_size)
    stock = x.clone()
    dist.all_reduce(stock)
    return tuple(out.shape), (out - stock).abs().max().item(), stock.abs().max().item()


def autograd_identity(rank, world, algo):
    """backward of the all-reduce is the identity (Megatron's reduce-from-TP-region contract)."""
    x = _contribution(3, rank, 12, torch.float32).requires_grad_()
    y = fo.all_reduce(x, algo=algo)
    dy = _contribution(4, 0, 12, torch.float32)  # the same dout on every rank (replicated output)
    y.backward(dy)
    return bool(torch.equal(x.grad, dy))


def auto_choice(rank, world, table, shape, local_world_size=None):
    """Which path "auto" took: a trace with executor waits means ours ran, none means stock."""
    from tests.support.chooser import active

    with active(table=table):
        ctx = OverlapContext(check_peers=False, trace=[])
        x = torch.ones(shape)
        out = fo.all_reduce(x, algo="auto", local_world_size=local_world_size, context=ctx)
        return bool(ctx.trace), bool(torch.equal(out, torch.full(shape, float(world))))


def bad_input(rank, world, kind):
    if kind == "int":
        fo.all_reduce(torch.ones(4, dtype=torch.int64), algo="ring")
    elif kind == "algo":
        fo.all_reduce(torch.ones(4), algo="tree")
    elif kind == "layout":
        fo.all_reduce(torch.ones(4), algo="hierarchical", local_world_size=world + 1)


def calibrate(rank, world, path, sizes, local_world_size=None):
    """The calibration command's measure + write on the pool's group; rank 0 writes `path`."""
    from megatron_flashoverlap.tools import calibrate_allreduce as cal

    rows = cal.measure(sizes, local_world_size=local_world_size, dtype=torch.float32, iters=2, warmup=1)
    if rank == 0:
        cal.write(path, cal.table(rows, None, local_world_size, torch.float32, 2, note="test"))
    dist.barrier()
    return rows
