"""Worker-side bodies of tests/gloo/test_wire_dtype.py: the bf16 error of each wire dtype, and the bytes sent
(counted by benchmarks/harness/wire.py `Sends`, which the FP8 wire benchmark counts with too).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

import megatron_flashoverlap as fo
from benchmarks.harness.wire import Sends

BF16 = torch.bfloat16


def _stock_rs(partial: torch.Tensor, world: int) -> torch.Tensor:
    """Stock: dist's reduce-scatter of the bf16 partial [s, ...] -> own block [s/P, ...] (no fp32 anywhere)."""
    out = torch.empty((partial.shape[0] // world,) + tuple(partial.shape[1:]), dtype=partial.dtype)
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, partial.contiguous())
    return out


def _sq(a: torch.Tensor, ref: torch.Tensor) -> float:
    return (a.double() - ref).pow(2).sum().item()


def rs_errors(rank, world, s, b, k, h, seeds):
    """Squared errors (summed over `seeds` and this rank's block) of y [s/P, b, h] = RS(x_k @ w_k^T) against
    the fp64 formula on the same bf16 inputs: wire "input", wire "fp32", stock's bf16 reduce-scatter, the
    reference algo, and the floor (the fp64 result rounded once to bf16); plus the fp64 norm squared."""
    out = {key: 0.0 for key in ("input", "fp32", "stock", "reference", "floor", "norm")}
    out.update(reference_is_stock=True, input_is_fp32=True, input_is_stock=True)
    kl, sl = k // world, s // world
    for seed in seeds:
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(s, b, k, generator=g).to(BF16)
        w = (torch.randn(h, k, generator=g) / k ** 0.5).to(BF16)
        xk, wk = x[..., rank * kl:(rank + 1) * kl].contiguous(), w[:, rank * kl:(rank + 1) * kl].contiguous()
        y64 = (x.double() @ w.double().t())[rank * sl:(rank + 1) * sl]
        got = {wire: fo.matmul_reduce_scatter(xk, wk, plan=fo.OpPlan("flash", wire_dtype=wire))
               for wire in ("input", "fp32")}
        got["stock"] = _stock_rs(F.linear(xk, wk), world)
        got["reference"] = fo.matmul_reduce_scatter(xk, wk, algo="reference")
        got["floor"] = y64.to(BF16)
        for a, c in (("reference", "stock"), ("input", "fp32"), ("input", "stock")):
            out[f"{a}_is_{c}"] &= bool(torch.equal(got[a], got[c]))
        for key, y in got.items():
            assert y.dtype == BF16, (key, y.dtype)
            out[key] += _sq(y, y64)
        out["norm"] += y64.pow(2).sum().item()
    return out


def _globals(seed, *shapes):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*sh, generator=g).to(BF16) for sh in shapes]


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return (a.double() - ref.double()).abs().max().item() / max(ref.double().abs().max().item(), 1e-30)


def _run_rs(rank, world, wire, algo):
    """matmul_reduce_scatter forward: -> (output, stock bytes of its reduce-scatter)."""
    x, w = _globals(1, (8 * world, 2, 4 * world), (16, 4 * world))
    kl = 4
    xk, wk = x[..., rank * kl:(rank + 1) * kl].contiguous(), w[:, rank * kl:(rank + 1) * kl].contiguous()
    with Sends() as m:
        y = fo.matmul_reduce_scatter(xk, wk, plan=fo.OpPlan(algo, wire_dtype=wire))
    return y, m.sent, (world - 1) * y.numel() * 2  # a ring RS sends P-1 blocks of the output per rank


def _run_column_dgrad(rank, world, wire, algo):
    """all_gather_matmul backward (dgrad RS + wgrad AG of x in one walk): bytes of backward only."""
    xs, w, dy = _globals(2, (4, 2, 16), (3, 16), (4 * world, 2, 3))
    xs.requires_grad_(), w.requires_grad_()  # need_dw: the wgrad AG of x rides in the dgrad walk
    y = fo.all_gather_matmul(xs, w, plan=fo.OpPlan(algo, wire_dtype=wire))
    with Sends() as m:
        y.backward(dy)
    return xs.grad, m.sent, (world - 1) * (xs.grad.numel() + xs.numel()) * 2  # RS of dx + AG of x


def _run_tp_nosp(rank, world, wire, algo):
    """matmul_all_reduce forward: Flash-RS + Flash-AG = one all-reduce of y."""
    x, w = _globals(3, (4 * world, 2, 8), (16, 8))
    with Sends() as m:
        y = fo.matmul_all_reduce(x, w, plan=fo.OpPlan(algo, wire_dtype=wire, decode_all_reduce=None))
    return y, m.sent, 2 * (world - 1) * y.numel() // world * 2  # a ring AR: RS + AG, P-1 blocks each


def _run_allreduce_dgrad(rank, world, wire, algo):
    """matmul_allreduce_dgrad backward: the all-reduce of dx (its wgrad fills the tail, no bytes)."""
    x, w, dy = _globals(4, (4 * world, 2, 16), (3, 16), (4 * world, 2, 3))
    x.requires_grad_()
    y = fo.matmul_allreduce_dgrad(x, w, plan=fo.OpPlan(algo, wire_dtype=wire))
    with Sends() as m:
        y.backward(dy)
    return x.grad, m.sent, 2 * (world - 1) * x.grad.numel() // world * 2


def _run_query_split(rank, world, wire, algo):
    """query_split_attention forward: attention + projection + Flash-RS of y."""
    q, k, v, w = _globals(5, (4 * world, 2, 2, 8), (4 * world, 2, 2, 8), (4 * world, 2, 2, 8), (16, 16))
    with Sends() as m:
        y = fo.query_split_attention(q, k, v, w, plan=fo.OpPlan(algo, wire_dtype=wire))
    return y, m.sent, (world - 1) * y.numel() * 2


def _run_dp(rank, world, wire, algo):
    """matmul_wgrad_reduce_scatter on a bf16 bucket [L]: Flash-RS of (bucket + dW) over D shards."""
    dy, x = _globals(6 + rank, (8, 2, 6), (8, 2, 5))
    grad = _globals(7 + rank, (8 * world * 5,))[0]
    with Sends() as m:
        fo.matmul_wgrad_reduce_scatter(dy, x, fo.DPBucket(grad, 3), None, plan=fo.OpPlan(algo, wire_dtype=wire))
    shard = grad.numel() // world
    return grad[rank * shard:(rank + 1) * shard].clone(), m.sent, (world - 1) * shard * 2


OPS = {"matmul_reduce_scatter": _run_rs, "all_gather_matmul.dgrad": _run_column_dgrad,
       "matmul_all_reduce": _run_tp_nosp, "matmul_allreduce_dgrad.dgrad": _run_allreduce_dgrad,
       "query_split_attention": _run_query_split, "matmul_wgrad_reduce_scatter": _run_dp}


def wire_bytes(rank, world, op, wire):
    """One operator with algo="flash" and the given wire: send dtypes, bytes sent, stock's bytes, and the
    error of its output against algo="reference" with the same wire (relative to max |reference|)."""
    y, sent, stock = OPS[op](rank, world, wire, "flash")
    y_ref = OPS[op](rank, world, wire, "reference")[0]
    return {"dtypes": sorted({d for d, _ in sent}), "bytes": sum(n for _, n in sent), "stock_bytes": stock,
            "vs_reference": _rel(y, y_ref)}


def bad_wire(rank, world):
    """Every reduce-scattering operator with wire_dtype="bf16": -> the ValueError messages (before any send)."""
    msgs = []
    for run in OPS.values():
        try:
            run(rank, world, "bf16", "flash")
        except ValueError as e:
            msgs.append(str(e))
    return msgs
