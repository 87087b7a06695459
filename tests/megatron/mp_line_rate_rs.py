"""Worker bodies: the benchmarks' line-rate reduce-scatter (benchmarks/harness/line_rate_rs.py) against torch's
own on gloo.

`ops` runs the same reduce-scatters through torch's function (captured before the shim is installed) and
through the shim: sync, async + wait, AVG, a [s, b, h] tensor, two buckets in one async _coalescing_manager
(Megatron's bucket group), and returns the largest difference of each plus what the shim handed back.
`gpt` trains the same stock Megatron GPT (local spec, DDP + DistributedOptimizer, --overlap-grad-reduce)
twice, with torch's reduce-scatters and with the shim's, and returns both runs' parameters and the shim's
call counts.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import _coalescing_manager

from benchmarks.harness import line_rate_rs as lr
from tests.megatron import mp_ddp_gpt

NATIVE = dist.reduce_scatter_tensor


def _pair(rank, world, shape, seed):
    g = torch.Generator().manual_seed(seed + rank)
    x = torch.randn(*shape, generator=g)
    return x, torch.empty(shape[0] // world, *shape[1:]), torch.empty(shape[0] // world, *shape[1:])


def _diff(a, b):
    return (a - b).abs().max().item() / max(1.0, b.abs().max().item())


def ops(rank, world):
    out, before = {}, dict(lr.CALLS)
    with lr.line_rate_reduce_scatter():
        x, want, got = _pair(rank, world, (world * 40,), 1)
        NATIVE(want, x)
        out["sync_ret"] = dist.reduce_scatter_tensor(got, x)
        out["sync"] = _diff(got, want)
        x, want, got = _pair(rank, world, (world * 6, 3, 5), 2)
        NATIVE(want, x)
        h = dist.reduce_scatter_tensor(got, x, async_op=True)
        out["async_type"] = type(h).__name__
        h.wait()
        out["async_sbh"] = _diff(got, want)
        NATIVE(want, x, op=dist.ReduceOp.AVG)
        dist.reduce_scatter_single(got, x, op=dist.ReduceOp.AVG)
        out["avg"] = _diff(got, want)
        from megatron.core.distributed import param_and_grad_buffer as pgb
        pairs = [_pair(rank, world, (world * n,), 10 + n) for n in (24, 8)]
        for x, want, _ in pairs:
            NATIVE(want, x)
        with pgb._coalescing_manager(dist.group.WORLD, async_ops=True) as cm:
            for x, _, got in pairs:
                pgb.dist_reduce_scatter_func(got, x, group=dist.group.WORLD, async_op=True)
        out["cm_works"] = len(cm.works)
        cm.wait()
        out["coalesced"] = max(_diff(got, want) for _, want, got in pairs)
        out["calls"] = {k: lr.CALLS[k] - before[k] for k in before}
    out["restored"] = dist.reduce_scatter_tensor is NATIVE and pgb._coalescing_manager is _coalescing_manager
    return out


def gpt(rank, world, tp=1, sp=False, steps=2):
    """-> {"native": params, "ring": params, "calls": {...}} for the stock GPT (module docstring)."""
    from megatron.core import parallel_state as ps

    from megatron_flashoverlap.megatron import models as tm

    tm.init_tp(tp)
    try:
        native = mp_ddp_gpt._run("stock", tp, sp, 2, steps, 2, {}, False, None)
        before = dict(lr.CALLS)
        with lr.line_rate_reduce_scatter():
            ring = mp_ddp_gpt._run("stock", tp, sp, 2, steps, 2, {}, False, None)
        calls = {k: lr.CALLS[k] - before[k] for k in before}
        return {"native": native["params"], "ring": ring["params"], "moved": min(native["moves"].values()), "calls": calls,
                "dp": ps.get_data_parallel_world_size()}
    finally:
        tm.destroy()
