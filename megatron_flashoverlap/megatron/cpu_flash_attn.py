"""flash-attn 2's two inference entry points in plain torch, for Megatron's dynamic engine on CPU (`cpu.enable()`).

Megatron's dynamic inference context keeps K/V in a paged cache and its Attention calls flash-attn 2 (a CUDA
kernel) for every step; these are the same functions, written request by request (each request's attention
sees only its own keys, so a request's output does not depend on the batch), fp32 inside, q's dtype out:

    flash_attn_varlen_func(q [Tq, H, D], k, v, cu_seqlens_q [B+1], cu_seqlens_k [B+1], max_seqlen_q, max_seqlen_k,
                           softmax_scale, causal, window_size, block_table [B, n_blocks] | None,
                           return_attn_probs) -> out [Tq, H, D]  (, lse [H, Tq], None)
        k, v: [Tk, Hk, D] packed, or the paged cache [num_blocks, block_size, Hk, D] with block_table
    flash_attn_with_kvcache(q [B, S, H, D], k_cache, v_cache (paged, as above), cache_seqlens [B],
                            softmax_scale, causal, window_size, block_table, num_splits, return_softmax_lse)
        -> out [B, S, H, D]  (, lse [B, H, S])

Causal masks align bottom-right, as flash-attn's do: query i of a request with q_len queries and k_len keys
sees keys j <= k_len - q_len + i (and, with a left window w >= 0, j >= k_len - q_len + i - w). Grouped-query
attention: Hk divides H, each K/V head serves H / Hk query heads.
"""
from __future__ import annotations

import dataclasses

import torch


def _keys(cache: torch.Tensor, table_row, start: int, length: int) -> torch.Tensor:
    """One request's [length, Hk, D]: rows start..start+length of packed `cache`, or its paged blocks."""
    if table_row is None:
        return cache[start:start + length]
    block = cache.shape[1]
    blocks = table_row[:(length + block - 1) // block].long()
    return cache.index_select(0, blocks).reshape(-1, *cache.shape[2:])[:length]


def _attend(q, k, v, scale: float, causal: bool, window) -> tuple[torch.Tensor, torch.Tensor]:
    """q [Sq, H, D], k / v [Sk, Hk, D] -> (out [Sq, H, D] in q's dtype, lse [H, Sq] fp32)."""
    sq, heads, sk = q.shape[0], q.shape[1], k.shape[0]
    if heads % k.shape[1]:
        raise ValueError(f"flash_attn (CPU): {heads} query heads are not a multiple of {k.shape[1]} K/V heads")
    group = heads // k.shape[1]
    kf = k.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, Sk, D]
    vf = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = torch.matmul(q.float().transpose(0, 1), kf.transpose(1, 2)) * scale  # [H, Sq, Sk]
    last = torch.arange(sq).unsqueeze(1) + (sk - sq)  # [Sq, 1]: the last key each query may see
    keys = torch.arange(sk).unsqueeze(0)
    allowed = keys <= last if causal else torch.ones(sq, sk, dtype=torch.bool)
    left = -1 if window is None else window[0]
    if left >= 0:
        allowed = allowed & (keys >= last - left)
    scores = scores.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [H, Sq]
    out = torch.matmul(torch.softmax(scores, dim=-1), vf)  # [H, Sq, D]
    return out.transpose(0, 1).to(q.dtype), lse


@dataclasses.dataclass(frozen=True)
class _Options:
    """flash-attn's keyword options that Megatron passes; any other is refused (not silently ignored)."""

    softmax_scale: float | None = None
    causal: bool = False
    window_size: tuple = (-1, -1)
    block_table: torch.Tensor | None = None
    return_attn_probs: bool = False  # varlen: also return lse (Megatron: the softmax-offset correction)
    return_softmax_lse: bool = False  # kvcache: the same
    num_splits: int = 0  # a CUDA work split: no meaning here
    dropout_p: float = 0.0

    @classmethod
    def of(cls, where: str, options: dict) -> "_Options":
        unknown = sorted(set(options) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"{where} (CPU): options {unknown} are not implemented by the CPU stand-in; run on a "
                             f"GPU with flash-attn installed")
        made = cls(**options)
        if made.dropout_p:
            raise ValueError(f"{where} (CPU): dropout_p must be 0 (inference only)")
        return made

    def scale(self, q: torch.Tensor) -> float:
        return q.shape[-1] ** -0.5 if self.softmax_scale is None else self.softmax_scale


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, **options):
    """Packed variable-length attention (prefill and mixed steps); see the module docstring."""
    opt = _Options.of("flash_attn_varlen_func", options)
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    out, lse = torch.empty_like(q), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
    for b in range(len(cq) - 1):
        row = None if opt.block_table is None else opt.block_table[b]
        start = 0 if row is not None else ck[b]
        kb, vb = _keys(k, row, start, ck[b + 1] - ck[b]), _keys(v, row, start, ck[b + 1] - ck[b])
        out[cq[b]:cq[b + 1]], lse[:, cq[b]:cq[b + 1]] = _attend(q[cq[b]:cq[b + 1]], kb, vb, opt.scale(q),
                                                                opt.causal, opt.window_size)
    return (out, lse, None) if opt.return_attn_probs else out


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, **options):
    """Decode steps against the (paged) K/V cache; new K/V (`k=`, `v=`) must already be in it."""
    if k is not None or v is not None:
        raise ValueError("flash_attn_with_kvcache (CPU): appending k / v is not implemented; write them into "
                         "the cache first (Megatron's dynamic context does)")
    opt = _Options.of("flash_attn_with_kvcache", options)
    out = torch.empty_like(q)
    lse = q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)
    for b, n in enumerate(cache_seqlens.tolist()):
        row = None if opt.block_table is None else opt.block_table[b]
        kb = _keys(k_cache if row is not None else k_cache[b], row, 0, n)
        vb = _keys(v_cache if row is not None else v_cache[b], row, 0, n)
        out[b], lse[b] = _attend(q[b], kb, vb, opt.scale(q), opt.causal, opt.window_size)
    return (out, lse) if opt.return_softmax_lse else out
