"""Worker-side bodies of the operator numerics tests (run on every rank by the gloo pool).

Every rank builds the same global tensors from one seed, takes its shards, runs an operator and the
reference formula on the global tensors, and returns the max errors; the test asserts on them.
"""
from __future__ import annotations

import torch

import megatron_flashoverlap as fo

DT = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _globals(seed, s, b, h, n, dtype):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(s, b, h, generator=g).to(dtype)
    w = torch.randn(n, h, generator=g).to(dtype) / h ** 0.5
    bias = torch.randn(n, generator=g).to(dtype)
    dy = torch.randn(s, b, n, generator=g).to(dtype)
    return x, w, bias, dy


def _plan(algo, num_chunks=None, **knobs):
    """The OpPlan of one case: num_chunks is slicing's knob (the tests sweep it for every algo)."""
    return fo.OpPlan(algo, num_chunks=num_chunks if algo == "slicing" else None, **knobs)


def _err(a, b):
    """Max abs error relative to the reference's max magnitude."""
    if not a.numel():
        return 0.0
    b = b.double()
    return (a.double() - b).abs().max().item() / max(b.abs().max().item(), 1e-30)


def ag_matmul(rank, world, algo, s, b, h, n, dtype="float32", seed=0, num_chunks=None, keep=False, bias=True):
    """Column-parallel: global W [n, h] split by rows; errors of y, dx, dw, db vs the dense formula and
    the bitwise comparison of y with algo="reference"."""
    dt = DT[dtype]
    x, w, bb, dy = _globals(seed, s, b, h, n, dt)
    sl, nl = s // world, n // world
    xs = x[rank * sl:(rank + 1) * sl].clone().requires_grad_()
    ws = w[rank * nl:(rank + 1) * nl].clone().requires_grad_()
    bs = bb[rank * nl:(rank + 1) * nl].clone().requires_grad_() if bias else None
    y = fo.all_gather_matmul(xs, ws, bias=bs, plan=_plan(algo, num_chunks, keep_gathered=keep))
    dys = dy[:, :, rank * nl:(rank + 1) * nl]
    y.backward(dys)
    with torch.no_grad():
        y_ref = fo.all_gather_matmul(xs, ws, bias=bs, algo="reference")
    # dense formula in float64 on the global tensors
    xd, wd, dyd = x.double(), w.double(), dy.double()
    yd = xd @ wd[rank * nl:(rank + 1) * nl].t() + (bb.double()[rank * nl:(rank + 1) * nl] if bias else 0)
    dxd = (dyd @ wd)[rank * sl:(rank + 1) * sl]
    dwd = dyd[:, :, rank * nl:(rank + 1) * nl].reshape(-1, nl).t() @ xd.reshape(-1, h)
    out = {"y_vs_ref_bitwise": bool(torch.equal(y, y_ref)), "y_vs_ref": _err(y, y_ref), "y": _err(y, yd), "dx": _err(xs.grad, dxd),
           "dw": _err(ws.grad, dwd), "scale": yd.abs().max().item()}
    if bias:
        dyl = dyd[:, :, rank * nl:(rank + 1) * nl]
        # a sum's rounding error scales with the sum of the magnitudes, not with the (possibly cancelling) result
        out["db"] = (bs.grad.double() - dyl.sum((0, 1))).abs().max().item() / dyl.abs().sum((0, 1)).max().item()
    return out


def matmul_rs(rank, world, algo, s, b, k, h, dtype="float32", seed=0, num_chunks=None):
    """Row-parallel: global W [h, k] split by columns; errors of y, dx, dw vs the dense formula."""
    dt = DT[dtype]
    x, w, _, dy = _globals(seed, s, b, k, h, dt)
    kl, sl = k // world, s // world
    xs = x[:, :, rank * kl:(rank + 1) * kl].clone().requires_grad_()
    ws = w[:, rank * kl:(rank + 1) * kl].clone().requires_grad_()
    y = fo.matmul_reduce_scatter(xs, ws, plan=_plan(algo, num_chunks))
    y.backward(dy[rank * sl:(rank + 1) * sl])
    with torch.no_grad():
        y_ref = fo.matmul_reduce_scatter(xs, ws, algo="reference")
    xd, wd, dyd = x.double(), w.double(), dy.double()
    yd = (xd @ wd.t())[rank * sl:(rank + 1) * sl]
    dxd = (dyd @ wd)[:, :, rank * kl:(rank + 1) * kl]
    dwd = dyd.reshape(-1, h).t() @ xd.reshape(-1, k)[:, rank * kl:(rank + 1) * kl]
    return {"y_vs_ref": _err(y, y_ref), "y": _err(y, yd), "dx": _err(xs.grad, dxd), "dw": _err(ws.grad, dwd),
            "scale": yd.abs().max().item(), "y_dtype_ok": y.dtype == dt}


def _raises(fn):
    try:
        fn()
    except ValueError as e:
        return str(e)
    return None


def bad_inputs(rank, world):
    """Each bad input, called identically on every rank: the ValueError text (None if nothing raised)."""
    x = torch.randn(4, 2, 8)
    w = torch.randn(6, 8)
    out = {
        "rs_indivisible": _raises(lambda: fo.matmul_reduce_scatter(torch.randn(world * 2 + 1, 2, 8), w)),
        "dtype": _raises(lambda: fo.all_gather_matmul(x, w.to(torch.bfloat16))),
        "device": _raises(lambda: fo.all_gather_matmul(x, w.to("meta"))),
        "weight_shape": _raises(lambda: fo.all_gather_matmul(x, torch.randn(6, 7))),
        "transposed_weight": _raises(lambda: fo.matmul_reduce_scatter(torch.randn(world * 2, 2, 8), torch.randn(8, 6))),
        "not_3d": _raises(lambda: fo.all_gather_matmul(x.view(8, 8), w)),
        "int_dtype": _raises(lambda: fo.all_gather_matmul(x.long(), w.long())),
        "bias_shape": _raises(lambda: fo.all_gather_matmul(x, w, bias=torch.randn(5))),
        "unknown_algo": _raises(lambda: fo.all_gather_matmul(x, w, algo="ring")),
        "slicing_no_chunks": _raises(lambda: fo.matmul_reduce_scatter(torch.randn(world * 2, 2, 8), w, algo="slicing")),
    }
    return out


def disagreeing_ranks(rank, world):
    """Rank 1 passes a longer sequence than its peers: every rank must raise, none may hang."""
    x = torch.randn(4 + (rank == 1), 2, 8)
    # a fresh context: the default one checks a (group, op, shape) once per process, and an earlier test on
    # this worker may have agreed on rank 0's shape already (then only rank 1 would check: the documented hang)
    return _raises(lambda: fo.all_gather_matmul(x, torch.randn(6, 8), context=fo.OverlapContext()))


def group_of_one(rank, world):
    """A group of size 1 is a plain GEMM: bitwise equal to F.linear, with and without autograd."""
    groups = [torch.distributed.new_group([r]) for r in range(world)]
    x = torch.randn(4, 2, 8, requires_grad=True)
    w = torch.randn(6, 8)
    y1 = fo.all_gather_matmul(x, w, groups[rank])
    y2 = fo.matmul_reduce_scatter(x, w, groups[rank])
    ref = torch.nn.functional.linear(x, w)
    return bool(torch.equal(y1, ref) and torch.equal(y2, ref))


def dead_peer(rank, world, timeout_s):
    """Rank 1 never calls the operator (dead or diverged): rank 0 must raise PeerTimeoutError in time."""
    import time
    from datetime import timedelta

    if rank != 0:
        return "absent"
    ctx = fo.OverlapContext(timeout=timedelta(seconds=timeout_s), check_peers=False)
    t0 = time.monotonic()
    try:
        fo.all_gather_matmul(torch.randn(4, 2, 8), torch.randn(6, 8), context=ctx)
    except fo.PeerTimeoutError as e:
        return {"message": str(e), "seconds": time.monotonic() - t0}
    return {"message": None, "seconds": time.monotonic() - t0}


def _column_run(rank, world, x, w, dy, hop_chunks, algo="flash"):
    """y, dx, dw of the column operator on this rank's shards (bias-free)."""
    sl, nl = x.shape[0] // world, w.shape[0] // world
    xs = x[rank * sl:(rank + 1) * sl].clone().requires_grad_()
    ws = w[rank * nl:(rank + 1) * nl].clone().requires_grad_()
    y = fo.all_gather_matmul(xs, ws, plan=fo.OpPlan(algo, hop_chunks=hop_chunks))
    y.backward(dy[:, :, rank * nl:(rank + 1) * nl])
    return y.detach(), xs.grad, ws.grad


def _row_run(rank, world, x, w, dy, hop_chunks, algo="flash"):
    """y, dx, dw of the row operator: x [s, b, k] split by columns, w [h, k] by columns."""
    kl, sl = x.shape[-1] // world, x.shape[0] // world
    xs = x[:, :, rank * kl:(rank + 1) * kl].clone().requires_grad_()
    ws = w[:, rank * kl:(rank + 1) * kl].clone().requires_grad_()
    y = fo.matmul_reduce_scatter(xs, ws, plan=fo.OpPlan(algo, hop_chunks=hop_chunks))
    y.backward(dy[rank * sl:(rank + 1) * sl])
    return y.detach(), xs.grad, ws.grad


def hop_chunks_vs_one(rank, world, s, b, h, n, c, dtype="float32", seed=0):
    """Both operators with `c` sub-chunks per hop against the same ring with c = 1 (bitwise flags) and
    against the float64 formula on the global tensors (errors)."""
    dt = DT[dtype]
    x, w, _, dy = _globals(seed, s, b, h, n, dt)  # column: x [s,b,h], w [n,h], dy [s,b,n]
    col, col1 = _column_run(rank, world, x, w, dy, c), _column_run(rank, world, x, w, dy, 1)
    col_ref = _column_run(rank, world, x, w, dy, None, algo="reference")
    xd, wd, dyd = x.double(), w.double(), dy.double()
    sl, nl = s // world, n // world
    col_want = (xd @ wd[rank * nl:(rank + 1) * nl].t(), (dyd @ wd)[rank * sl:(rank + 1) * sl],
                dyd[:, :, rank * nl:(rank + 1) * nl].reshape(-1, nl).t() @ xd.reshape(-1, h))
    # row: x2 [s, b, n] (input width n), w2 [h, n], dy2 [s, b, h]
    x2, w2, dy2 = dy, w.t().contiguous(), x
    row, row1 = _row_run(rank, world, x2, w2, dy2, c), _row_run(rank, world, x2, w2, dy2, 1)
    x2d, w2d, dy2d = x2.double(), w2.double(), dy2.double()
    row_want = ((x2d @ w2d.t())[rank * sl:(rank + 1) * sl], (dy2d @ w2d)[:, :, rank * nl:(rank + 1) * nl],
                dy2d.reshape(-1, h).t() @ x2d.reshape(-1, n)[:, rank * nl:(rank + 1) * nl])
    out = {}
    for name, got, one, want in (("col", col, col1, col_want), ("row", row, row1, row_want)):
        for k, g, o, wv in zip(("y", "dx", "dw"), got, one, want):
            out[f"{name}.{k}.same_as_c1"] = bool(torch.equal(g, o))
            out[f"{name}.{k}"] = _err(g, wv)
    out["col.y.same_as_reference"] = bool(torch.equal(col[0], col_ref[0]))
    ctx = fo.OverlapContext(trace=[])
    with torch.no_grad():
        fo.all_gather_matmul(x[rank * sl:(rank + 1) * sl], w[rank * nl:(rank + 1) * nl], plan=fo.OpPlan(hop_chunks=c),
                             context=ctx)
    out["ag_slices"] = sum(e.what == "compute" for e in ctx.trace)  # GEMM slices the forward ring ran
    return out


def hop_chunks_errors(rank, world):
    """Each bad hop_chunks request: the ValueError text (None if nothing raised)."""
    x, w = torch.randn(4, 2, 8), torch.randn(6, 8)
    return {
        "zero": _raises(lambda: fo.all_gather_matmul(x, w, plan=fo.OpPlan(hop_chunks=0))),
        "float": _raises(lambda: fo.matmul_reduce_scatter(torch.randn(world * 2, 2, 8), w,
                                                          plan=fo.OpPlan(hop_chunks=2.0))),
        "slicing": _raises(lambda: fo.all_gather_matmul(x, w, plan=fo.OpPlan("slicing", num_chunks=2, hop_chunks=2))),
        "bidir": _raises(lambda: fo.matmul_reduce_scatter(torch.randn(world * 2, 2, 8), w,
                                                          plan=fo.OpPlan("flash_bidir", hop_chunks=2))),
        "forced_ok": _raises(lambda: _forced(x, w)),
    }


def _forced(x, w):
    with fo.force_reference():
        fo.all_gather_matmul(x, w, plan=fo.OpPlan(hop_chunks=3))


def reference_column_backward_trace(rank, world, keep=False):
    """The (what, label) events of algo="reference"'s column backward (all_gather_matmul's), in order."""
    x, w, _, dy = _globals(0, 8 * world, 2, 16, 4 * world, torch.float32)
    sl, nl = 8, 4
    xs = x[rank * sl:(rank + 1) * sl].clone().requires_grad_()
    ws = w[rank * nl:(rank + 1) * nl].clone().requires_grad_()
    ctx = fo.OverlapContext(trace=[])
    y = fo.all_gather_matmul(xs, ws, plan=fo.OpPlan("reference", keep_gathered=keep), context=ctx)
    forward = len(ctx.trace)
    y.backward(dy[:, :, rank * nl:(rank + 1) * nl])
    return [(e.what, e.label) for e in ctx.trace[forward:]]
