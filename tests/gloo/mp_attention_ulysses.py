"""Worker bodies for the Ulysses tests (op level): every rank builds the same global q, k, v, dy, takes its
sequence shard (Megatron's zigzag split or contiguous), runs `ulysses_attention` over the whole group and
compares output and input gradients with full attention of the global tensors in one process: `full_attention`,
plain torch softmax attention in float64, written here (not the kernel the operator calls, ops/attention/core.py),
with Megatron's conventions: scores * scale, masked positions -10000 (not -inf), softmax, probs @ v, each
key/value group serving np/ng consecutive query heads."""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_flashoverlap.ops.attention.core import Attend

DT = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _err(a, b):
    return (a.double() - b.double()).abs().max().item()


def full_attention(q, k, v, scale: float, pad=None):
    """Causal attention of the whole sequence in float64: q [s, b, np, hn], k/v [s, b, ng, hn], pad bool
    [b, 1, s, s] (True = masked) or None -> ctx [s, b, np*hn] (float64, differentiable)."""
    s, b, heads, hn = q.shape
    rep = heads // k.shape[2]
    q, k, v = (t.double() for t in (q, k, v))
    k, v = (t.repeat_interleave(rep, dim=2) for t in (k, v))  # group g serves heads g*rep .. g*rep+rep-1
    scores = torch.einsum("sbnh,tbnh->bnst", q, k) * scale
    mask = torch.ones(s, s, dtype=torch.bool).triu(1)  # key t later than query s
    if pad is not None:
        mask = mask | pad
    probs = torch.softmax(scores.masked_fill(mask, -10000.0), dim=-1)
    return torch.einsum("bnst,tbnh->sbnh", probs, v).reshape(s, b, heads * hn)


def shard_rows(s: int, rank: int, world: int, zigzag: bool) -> torch.Tensor:
    """Rows of this rank: chunks (r, 2P-1-r) of 2P (Megatron's get_batch_on_this_cp_rank) or block r."""
    if not zigzag:
        n = s // world
        return torch.arange(rank * n, (rank + 1) * n)
    c = s // (2 * world)
    return torch.cat([torch.arange(k * c, (k + 1) * c) for k in (rank, 2 * world - 1 - rank)])


def _globals(seed, s, b, heads, groups, hn, dtype):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(s, b, n, hn, generator=g).to(dtype) for n in (heads, groups, groups))
    dy = torch.randn(s, b, heads * hn, generator=g).to(dtype)
    pad = torch.zeros(b, 1, s, s, dtype=torch.bool)
    pad[0, :, :, s - s // 4:] = True
    return q, k, v, dy, pad


def vs_full(rank, world, algo="flash", zigzag=True, padding=False, groups=4, dtype="float32", s=16, b=2,
            heads=8, hn=4, seed=1, op_zigzag=None):
    from megatron_flashoverlap.ops.attention.ulysses import ulysses_attention

    dt = DT[dtype]
    q, k, v, dy, pad = _globals(seed, s, b, heads, groups, hn, dt)
    idx = shard_rows(s, rank, world, zigzag)
    loc = [t[idx].clone().requires_grad_() for t in (q, k, v)]
    mask_rows = pad[:, :, idx, :] if padding else None  # Megatron slices the mask rows only
    attend = Attend(causal=True, mask=mask_rows, zigzag=zigzag if op_zigzag is None else op_zigzag)
    y = ulysses_attention(*loc, dist.group.WORLD, attend=attend, algo=algo)
    y.backward(dy[idx])
    full = [t.double().requires_grad_() for t in (q, k, v)]  # the same (dtype-rounded) values, in float64
    ref = full_attention(*full, hn ** -0.5, pad if padding else None)
    ref.backward(dy.double())
    out = {"y": _err(y, ref[idx]), "dtype_ok": y.dtype == dt, "scale": ref.abs().max().item()}
    for n, a, f in zip(("dq", "dk", "dv"), loc, full):
        out[n] = _err(a.grad, f.grad[idx])
    return out


def fused_vs_reference(rank, world, s=16, b=2, h=16, heads=4, groups=2, hn=4, dtype="float32", seed=2, bias=True):
    """Fused Ulysses (QKV/proj inside the a2a steps) vs the unfused stock path on the same shards, and
    y vs one-process attention of the global tensors. Gradients of the replicated weights are all-reduced
    over the group (as CP training does) before comparing."""
    from megatron_flashoverlap.ops.attention.core import zigzag_positions
    from megatron_flashoverlap.ops.attention.ulysses_fused import ulysses_fused_attention

    dt = DT[dtype]
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(s, b, h, generator=g).to(dt)
    wq = (torch.randn(groups * (heads // groups + 2) * hn, h, generator=g) / h ** 0.5).to(dt)
    bq = torch.randn(wq.shape[0], generator=g).to(dt) if bias else None
    wp = (torch.randn(h, heads * hn, generator=g) / (heads * hn) ** 0.5).to(dt)
    dy = torch.randn(s, b, h, generator=g).to(dt)
    idx = shard_rows(s, rank, world, True)
    res = {}
    for algo in ("flash", "reference"):
        leaves = [t.clone().requires_grad_() if t is not None else None for t in (x[idx], wq, bq, wp)]
        y = ulysses_fused_attention(leaves[0], leaves[1], leaves[3], dist.group.WORLD, b_qkv=leaves[2],
                                    attend=Attend(heads=heads), algo=algo)
        y.backward(dy[idx])
        grads = [t.grad for t in leaves if t is not None]
        for gr in grads[1:]:
            dist.all_reduce(gr)
        res[algo] = (y.detach(), grads)
    mixed = F_linear(x.double(), wq.double(), None if bq is None else bq.double()).view(s, b, groups, -1)
    per = heads // groups  # Megatron's packed linear_qkv layout, per group: [its per query heads, k, v]
    qf, kf, vf = torch.split(mixed, [per * hn, hn, hn], dim=3)
    qf = qf.reshape(s, b, heads, hn)
    ref = F_linear(full_attention(qf, kf, vf, hn ** -0.5), wp.double(), None)
    (yf, gf), (ys, gs) = res["flash"], res["reference"]
    assert zigzag_positions(s, world)[0] == 0
    return {"y_vs_stock": _err(yf, ys), "grads_vs_stock": max(_err(a, c) for a, c in zip(gf, gs)),
            "y_vs_full": _err(yf, ref[idx]), "scale": max(ref.abs().max().item(), 1.0),
            "gscale": max(max(c.abs().max().item() for c in gs), 1.0), "dtype_ok": yf.dtype == dt}


def F_linear(x, w, b):
    return torch.nn.functional.linear(x, w, b)
