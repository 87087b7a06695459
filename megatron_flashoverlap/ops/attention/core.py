"""Core attention math for the attention operators: masks, one query block, the unfused references.

    q [sq, b, np, hn]    k, v [sk, b, ng, hn]  (ng divides np: grouped-query attention)
    mask (bool, True = masked out) broadcastable to [b, np, sq, sk]
    ctx [sq, b, np*hn]

The numerics follow Megatron's local `DotProductAttention` (its unfused softmax path): scores = baddbmm(q, k^T,
alpha=scale) in the input dtype, masked with -10000 (not -inf: a fully masked row becomes uniform, as in
Megatron), softmax in fp32 for bf16/fp16 inputs where `softmax_in_fp32` (Megatron's
`attention_softmax_in_fp32`) else in the input dtype, probs cast back, dropout, ctx = probs @ v.

`Attend` is what a caller asks (the operators' `attend=`: causal, mask, softmax scale, dropout, seed, zigzag,
heads), checked when it is made; `make_spec` resolves it per call into the `AttnSpec` the math runs.
`AttnSpec` carries everything that decides which keys a query row sees, so any row block can be computed
alone (the query-split operator) and the whole sequence gives the same rows (the reference):
- `causal`: key j is masked for query i when pos[j] > pos[i]; `positions` [s] gives pos (Megatron's
  zigzag context-parallel order, see `zigzag_positions`); None = natural order.
- `mask`: an explicit bool mask [b|1, np|1, s, s] (padding), OR-ed with the causal rule.
- `dropout_p` with `keep`: stock's own draw. `draw_keep` draws the whole sequence's mask [b, np, s, sk] as
  torch's dropout draws it for probs of that shape (the same generator, the same numbers consumed), and
  `apply_keep` applies a block's rows as dropout applies its draw, so a block of rows gets stock's dropout.
- `dropout_p` with `seed` (no `keep`): a counter-based keep-mask, a hash of (seed, batch and head, global row,
  key) computed for a whole block without a per-row launch (`keep_mask`), for an operator that never holds
  the whole sequence's probs on one rank (Ulysses). `seed` is an int or a 0-dim int64 tensor (drawn on the
  device from Megatron's RNG, no host sync).
Either way a row's mask does not depend on how the rows are split (query split == reference).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttnSpec:
    scale: float
    causal: bool = True
    mask: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    dropout_p: float = 0.0
    seed: int | torch.Tensor = 0  # 0-dim int64 tensor: drawn on the device without a host sync
    keep: torch.Tensor | None = None  # bool [b, np, s, sk]: the drawn mask of the whole sequence (draw_keep)
    softmax_in_fp32: bool = True

    def rows_mask(self, a: int, b: int, sk: int, device) -> torch.Tensor | None:
        """The mask of query rows [a, b) against all sk keys: [.., b-a, sk] or None."""
        out = None if self.mask is None else self.mask[..., a:b, :]
        if self.causal:
            if self.positions is None:
                qp, kp = torch.arange(a, b, device=device), torch.arange(sk, device=device)
            else:
                qp, kp = self.positions[a:b].to(device), self.positions.to(device)
            c = kp[None, :] > qp[:, None]  # [b-a, sk]
            out = c if out is None else (out | c)
        return out


@dataclass(frozen=True, eq=False)
class Attend:
    """What a query attends to, as the attention operators' callers say it (`attend=`), checked once when made.

    causal         key j is masked for query i when it comes later in the sequence
    mask           bool [b|1, np|1, sq, sk], True = masked out (Megatron's convention), OR-ed with causal
    softmax_scale  None: 1/sqrt(head dim)
    dropout_p      on the probs, in [0, 1); the keep-masks are `keep` where given, else `seed`'s hash
    keep           bool [b, np, sq, sk]: the mask `draw_keep` drew for the whole sequence (stock's draw)
    seed           an int or a 0-dim int64 tensor: the counter-based masks' seed (`keep_mask`)
    softmax_in_fp32  bf16/fp16 scores take the softmax in fp32 (Megatron's attention_softmax_in_fp32)
    zigzag         the sequence in Megatron's zigzag split (ulysses_attention: the shards' layout, default True;
                   query_split_attention: balance causal blocks, default False); None: the operator's default
    heads          query heads of packed QKV projections (ulysses_fused_attention only; elsewhere q says)
    """
    causal: bool = True
    mask: torch.Tensor | None = None
    softmax_scale: float | None = None
    dropout_p: float = 0.0
    seed: int | torch.Tensor = 0
    zigzag: bool | None = None
    heads: int | None = None
    keep: torch.Tensor | None = None
    softmax_in_fp32: bool = True

    def __post_init__(self):
        if not 0.0 <= self.dropout_p < 1.0:
            raise ValueError(f"attention dropout_p must be in [0, 1); got {self.dropout_p}")
        if self.keep is not None and (self.keep.dtype != torch.bool or self.keep.dim() != 4 or not self.dropout_p):
            raise ValueError("attend.keep must be the bool [b, np, sq, sk] mask draw_keep draws, with dropout_p > 0 "
                             "(the rate it was drawn at); leave it None for no dropout")
        if self.mask is not None and self.mask.dtype != torch.bool:
            raise ValueError("attn_mask must be a bool tensor (True = masked out, Megatron's convention); "
                             "convert with mask < 0.5 or mask.bool()")

    def zigzagged(self, default: bool) -> bool:
        return default if self.zigzag is None else self.zigzag


CAUSAL = Attend()  # the default rule: causal, nothing else


def zigzag_positions(seq: int, world: int, device=None) -> torch.Tensor:
    """Natural position of each row of a sequence gathered from Megatron's zigzag CP split.

    The sequence is cut in 2*world chunks; CP rank r holds chunks (r, 2*world-1-r). Gathering the ranks'
    shards in rank order gives rows [c0, c(2P-1), c1, c(2P-2), ...]: pos [s] maps each row to its place."""
    if seq % (2 * world):
        raise ValueError(f"sequence length {seq} is not divisible by 2 * context_parallel_size = {2 * world}; "
                         f"pad the sequence (Megatron's get_batch_on_this_cp_rank needs the same)")
    c = seq // (2 * world)
    order = [k for r in range(world) for k in (r, 2 * world - 1 - r)]
    return torch.cat([torch.arange(k * c, (k + 1) * c, device=device) for k in order])


def expand_kv(t: torch.Tensor, heads: int) -> torch.Tensor:
    """[sk, b, ng, hn] -> [sk, b, np, hn] (each group repeated np/ng times, as Megatron does)."""
    rep = heads // t.shape[2]
    return t if rep == 1 else t.repeat_interleave(rep, dim=2)


def sum_kv_groups(g: torch.Tensor, groups: int) -> torch.Tensor:
    """expand_kv's backward: [sk, b, np, hn] -> [sk, b, ng, hn], each group's np/ng repeats summed."""
    sk, b, heads, hn = g.shape
    return g if groups == heads else g.view(sk, b, groups, heads // groups, hn).sum(3)


_M32 = 0xFFFFFFFF


def _mix32(x):
    """A 32-bit integer hash (x in [0, 2**32) -> [0, 2**32); Wellons' hash-prospector hash32, 2018). Both
    multipliers are below 2**31, so every product stays below 2**63: exact in int64, no overflow. Works on
    Python ints and int64 tensors alike."""
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & _M32
    x = x ^ (x >> 12)
    x = (x * 0x297A2D39) & _M32
    return x ^ (x >> 15)


def _mix32_(x: torch.Tensor) -> torch.Tensor:
    """`_mix32` in place on an int32 tensor holding the 32 bits of each value: the same bits. The products wrap
    modulo 2**32 (two's complement), and a right shift of int32 is arithmetic, so each shift is masked to the
    bits a logical shift keeps."""
    x ^= (x >> 15) & 0x1FFFF
    x *= 0x2C1B3C6D
    x ^= (x >> 12) & 0xFFFFF
    x *= 0x297A2D39
    x ^= (x >> 15) & 0x1FFFF
    return x


_TILE = 1 << 18  # elements of one CPU tile of the mask (1 MiB of int32): the hash's passes stay in cache


def _one_pass(device: torch.device) -> bool:
    """Whether keep_mask hashes a block in one pass (CUDA: one launch per op) rather than in CPU tiles."""
    return device.type == "cuda"


def keep_mask(spec: AttnSpec, b: int, heads: int, a: int, n: int, sk: int, device) -> torch.Tensor:
    """keep [b, np, n, sk] (bool) of query rows [a, a+n): a counter-based draw, uniform 32-bit hash of
    (seed, batch * np + head, global row a+i, key j) compared with keep_p * 2**32. A row's mask is a function of
    its global index alone, so any split into blocks gives the same masks (query split == reference); no
    generator state (the seed may be an int or a 0-dim int64 tensor).

        h_row [b*np, n]     = mix(mix(mix(seed) ^ (b*np index)) ^ (a + i))     int64, small
        keep  [b*np, n, sk] = mix(h_row ^ j) < keep_p * 2**32                  int32, in place

    The per-element hash runs in int32 in place: on CUDA in one pass over the block; on CPU in tiles of about
    `_TILE` elements (a few rows of one head), each hashed while it sits in cache."""
    s = _mix32((spec.seed ^ (spec.seed >> 32)) & _M32)  # fold a 64-bit seed into 32 bits
    ix = torch.arange(max(b * heads, n), device=device, dtype=torch.int64)
    h = _mix32(s ^ ix[:b * heads].view(b * heads, 1))  # [b*np, 1]
    h = _mix32(h ^ (ix[:n] + a).view(1, n))  # [b*np, n], values in [0, 2**32)
    h = (h - ((h >> 31) & 1) * 2 ** 32).to(torch.int32)  # the same 32 bits as int32
    keep = torch.empty((b * heads, n, sk), dtype=torch.bool, device=device)
    threshold = int((1.0 - spec.dropout_p) * 2 ** 32)  # keep where the unsigned hash is below it
    if threshold >= 2 ** 32:
        return keep.fill_(True).view(b, heads, n, sk)
    keys = torch.arange(sk, device=device, dtype=torch.int32)
    rows = max(1, _TILE // max(sk, 1))
    tiles = [(slice(None), slice(None))] if _one_pass(keep.device) else \
        [(g, slice(r, r + rows)) for g in range(b * heads) for r in range(0, n, rows)]
    for g, r in tiles:
        t = _mix32_(h[g, r, None] ^ keys)  # [rows, sk] (CUDA: [b*np, n, sk])
        t ^= -2 ** 31  # unsigned order -> signed order: flip the top bit of both sides
        torch.lt(t, threshold - 2 ** 31, out=keep[g, r])
    return keep.view(b, heads, n, sk)


def _fused_dropout(device: torch.device) -> bool:
    """Whether torch's dropout runs its fused kernel on `device` (native_dropout: CUDA) rather than the composite
    bernoulli_ + div_ + mul of other devices (aten/src/ATen/native/Dropout.cpp, is_fused_kernel_acceptable)."""
    return device.type == "cuda"


def draw_keep(shape, dtype: torch.dtype, p: float, device) -> torch.Tensor:
    """keep [shape] (bool): the mask torch.nn.functional.dropout(x, p) draws for an x of this shape and dtype on
    `device`, from the same generator, consuming the same random numbers (what the RNG gives next is what it gives
    after stock's dropout). Its reference is F.dropout itself (tests/megatron/test_attention_dropout.py)."""
    device = torch.device(device)
    if _fused_dropout(device):
        return torch.native_dropout(torch.ones(shape, dtype=dtype, device=device), p, True)[1]
    return torch.empty(shape, dtype=dtype, device=device).bernoulli_(1.0 - p).bool()


def apply_keep(probs: torch.Tensor, keep: torch.Tensor, p: float) -> torch.Tensor:
    """F.dropout's output for its draw `keep` (same shape as probs): composite (CPU): probs * (keep in probs'
    dtype, divided by 1 - p), bitwise; fused (CUDA): float(probs) * keep * scale, rounded once, with the kernel's
    scale fp32(1 / fp32(1 - p)) (tests/gpu checks it against F.dropout)."""
    if not _fused_dropout(probs.device):
        return probs * keep.to(probs.dtype).div_(1.0 - p)
    if probs.dtype == torch.float64:
        return probs * keep * (1.0 / (1.0 - p))
    scale = 1.0 / float(torch.tensor(1.0 - p, dtype=torch.float32))  # rounded to fp32 where the product runs
    return (probs.float() * keep * scale).to(probs.dtype)


def _dropout(probs: torch.Tensor, spec: AttnSpec, a: int) -> torch.Tensor:
    """probs [b, np, n, sk]; row i of the block uses the keep-mask of global row a+i: `spec.keep`'s rows
    (stock's draw), else the counter-based hash (`keep_mask`)."""
    b, heads, n, sk = probs.shape
    if spec.keep is not None:
        return apply_keep(probs, spec.keep[:, :, a:a + n], spec.dropout_p)
    keep = keep_mask(spec, b, heads, a, n, sk, probs.device)
    return probs * keep.to(probs.dtype) / (1.0 - spec.dropout_p)


def attention_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttnSpec, a: int = 0) -> torch.Tensor:
    """ctx [n, b, np*hn] of query rows q [n, b, np, hn] = rows [a, a+n) of the sequence; k, v full."""
    n, b, heads, hn = q.shape
    sk = k.shape[0]
    k, v = expand_kv(k, heads), expand_kv(v, heads)
    qb = q.reshape(n, b * heads, hn).transpose(0, 1)  # [b*np, n, hn]
    kb = k.reshape(sk, b * heads, hn).permute(1, 2, 0)  # [b*np, hn, sk]
    buf = torch.empty((b * heads, n, sk), dtype=q.dtype, device=q.device)
    scores = torch.baddbmm(buf, qb, kb, beta=0.0, alpha=spec.scale).view(b, heads, n, sk)
    if q.dtype in (torch.bfloat16, torch.float16) and spec.softmax_in_fp32:
        scores = scores.float()
    mask = spec.rows_mask(a, a + n, sk, q.device)
    if mask is not None:
        scores = scores.masked_fill(mask, -10000.0)
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    if spec.dropout_p > 0:
        probs = _dropout(probs, spec, a)
    vb = v.reshape(sk, b * heads, hn).transpose(0, 1)  # [b*np, sk, hn]
    ctx = torch.bmm(probs.view(b * heads, n, sk), vb).view(b, heads, n, hn)
    return ctx.permute(2, 0, 1, 3).reshape(n, b, heads * hn)  # [n, b, np*hn]


def attention_reference(q, k, v, spec: AttnSpec) -> torch.Tensor:
    """Unfused full attention (differentiable with plain autograd): ctx [s, b, np*hn]."""
    return attention_rows(q, k, v, spec, 0)


def check_attention_operands(op: str, q, k, v, weight=None) -> None:
    """q [s, b, np, hn], k/v [s, b, ng, hn] with ng | np, weight [h, np*hn]; errors name the fix."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"{op}: q, k, v must be [s, b, heads, head_dim] (Megatron's core-attention layout); "
                         f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape != v.shape or k.shape[1] != q.shape[1] or k.shape[3] != q.shape[3]:
        raise ValueError(f"{op}: k and v must both be [sk, {q.shape[1]}, ng, {q.shape[3]}]; got "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"{op}: {q.shape[2]} query heads are not a multiple of {k.shape[2]} key/value groups; "
                         f"set num_query_groups to a divisor of num_attention_heads")
    if q.dtype != k.dtype or q.dtype != v.dtype or (weight is not None and weight.dtype != q.dtype):
        raise ValueError(f"{op}: q, k, v (and the projection weight) must share one dtype")
    if weight is not None and (weight.dim() != 2 or weight.shape[1] != q.shape[2] * q.shape[3]):
        raise ValueError(f"{op}: the projection weight must be [h, {q.shape[2] * q.shape[3]}] (the local shard "
                         f"of linear_proj.weight, [out, in]); got {tuple(weight.shape)}")


def make_spec(q, attend: Attend, mask: torch.Tensor | None, positions: torch.Tensor | None = None,
              keep: torch.Tensor | None = None) -> AttnSpec:
    """The AttnSpec of one call: `attend`'s rule for q [s, b, np, hn] (scale default 1/sqrt(hn)), with `mask` and
    `keep` (attend.mask and attend.keep as the operator lays them out: gathered, permuted) and the rows'
    `positions`."""
    scale = attend.softmax_scale if attend.softmax_scale is not None else q.shape[-1] ** -0.5
    return AttnSpec(scale=scale, causal=attend.causal, mask=mask, positions=positions, dropout_p=attend.dropout_p,
                    seed=attend.seed, keep=keep, softmax_in_fp32=attend.softmax_in_fp32)
