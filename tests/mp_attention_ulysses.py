"""Worker bodies for the Ulysses tests (op level): every rank builds the same global q, k, v, dy, takes its
sequence shard (Megatron's zigzag split or contiguous), runs `ulysses_attention` over the whole group and
compares output and input gradients with full attention of the global tensors in one process."""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_flashoverlap.ops.attention import AttnSpec, attention_rows

DT = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _err(a, b):
    return (a.double() - b.double()).abs().max().item()


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
    from megatron_flashoverlap.ops.ulysses import ulysses_attention

    dt = DT[dtype]
    q, k, v, dy, pad = _globals(seed, s, b, heads, groups, hn, dt)
    idx = shard_rows(s, rank, world, zigzag)
    loc = [t[idx].clone().requires_grad_() for t in (q, k, v)]
    mask_rows = pad[:, :, idx, :] if padding else None  # Megatron slices the mask rows only
    y = ulysses_attention(*loc, dist.group.WORLD, causal=True, zigzag=zigzag if op_zigzag is None else op_zigzag, attn_mask=mask_rows, algo=algo)
    y.backward(dy[idx])
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = attention_rows(*full, AttnSpec(scale=hn ** -0.5, causal=True, mask=pad if padding else None), 0)
    ref.backward(dy)
    out = {"y": _err(y, ref[idx]), "dtype_ok": y.dtype == dt, "scale": ref.abs().max().item()}
    for n, a, f in zip(("dq", "dk", "dv"), loc, full):
        out[n] = _err(a.grad, f.grad[idx])
    return out
