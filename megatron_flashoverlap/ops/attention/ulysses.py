"""Ulysses context-parallel core attention: sequence shards <-> head shards around a full-sequence attention.

    q_s [s/P, b, np, hn]   k_s, v_s [s/P, b, ng, hn]   (this rank's sequence shard, all its heads)
    ctx_s [s/P, b, np*hn]

    forward  (q, k, v)_h = seq->heads(q_s, k_s, v_s)      [s, b, np/P, hn]: one merged pairwise walk
             ctx_h = attention((q, k, v)_h)               full sequence, head group r
             ctx_s = heads->seq(ctx_h)                    [s/P, b, np, hn] -> [s/P, b, np*hn]
    backward the duals: heads->seq of dq/dk/dv, seq->heads of dctx (ulysses_a2a.SeqToHeads/HeadsToSeq)
    algo     "flash" (pairwise steps on the executor) or "reference" (all_to_all_single): ULYSSES_ALGOS

Megatron's zigzag split (`get_batch_on_this_cp_rank`, 2P chunks, rank r holds chunks r and 2P-1-r):
the gathered rows are in rank order, not in sequence order. Attention is equivariant under a permutation
of rows as long as the causal rule uses the true positions, so nothing is reordered: the causal mask
compares `zigzag_positions` (RoPE was already applied per token before the a2a, with the same positions).
An explicit mask arrives as Megatron slices it: rows of this rank [B, 1, s/P, s] with keys in sequence
order; it is all-gathered over the group and its key columns are permuted to the gathered order.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ...config import ULYSSES_ALGOS
from ...runtime import OverlapContext, default_context, group_info
from ..checks import peers_agree
from ..registry import resolve_algo
from .core import CAUSAL, Attend, attention_rows, check_attention_operands, make_spec, zigzag_positions
from .ulysses_a2a import HeadsToSeq, SeqToHeads

__all__ = ["ULYSSES_ALGOS", "check_ulysses_heads", "gather_mask", "ulysses_attention"]


def check_ulysses_heads(op: str, heads: int, groups: int, world: int, tp: int = 1) -> None:
    if heads % world or groups % world:
        raise ValueError(
            f"{op}: {heads} query heads and {groups} key/value groups per tensor-parallel rank must both be "
            f"divisible by context_parallel_size={world}; num_attention_heads and num_query_groups must be "
            f"divisible by tensor_model_parallel_size x context_parallel_size = {tp * world}")


def gather_mask(mask: torch.Tensor | None, s_local: int, group, positions: torch.Tensor | None):
    """A Megatron CP mask -> [B, 1, s, s] in the gathered row/column order (None stays None).

    Accepts this rank's rows [B, 1, s/P, s] (keys in sequence order) or the full [B, 1, s, s]."""
    if mask is None:
        return None
    rank, world = group_info(group)
    if mask.shape[-2] == s_local and world > 1:
        parts = [torch.empty_like(mask, dtype=torch.uint8) for _ in range(world)]
        dist.all_gather(parts, mask.to(torch.uint8).contiguous(), group=group)
        mask = torch.cat(parts, dim=-2).bool()  # rows now in gathered order
    elif positions is not None:
        mask = mask.index_select(-2, positions.to(mask.device))
    return mask if positions is None else mask.index_select(-1, positions.to(mask.device))


def ulysses_attention(q_s: torch.Tensor, k_s: torch.Tensor, v_s: torch.Tensor, group=None, *,
                      attend: Attend | None = None, algo: str = "flash",
                      context: OverlapContext | None = None) -> torch.Tensor:
    """ctx_s [s/P, b, np*hn] of Ulysses attention over `group` (the context-parallel group), with autograd.

    attend (core.Attend; default causal): mask, softmax scale, dropout and zigzag: the shards follow
    Megatron's zigzag CP split (True, the default) or are contiguous (False).
    algo: "flash" (pairwise steps on the executor, q/k/v in one walk), "reference" (all_to_all_single)."""
    algo = resolve_algo("ulysses_attention", algo)
    attend = CAUSAL if attend is None else attend
    check_attention_operands("ulysses_attention", q_s, k_s, v_s)
    rank, world = group_info(group)
    check_ulysses_heads("ulysses_attention", q_s.shape[2], k_s.shape[2], world)
    octx = context or default_context()
    peers_agree("ulysses_attention", group, world, q_s.device, octx, *q_s.shape, *k_s.shape)
    s = q_s.shape[0] * world
    positions = zigzag_positions(s, world, q_s.device) if attend.zigzagged(True) and world > 1 else None
    spec = make_spec(q_s, attend, gather_mask(attend.mask, q_s.shape[0], group, positions), positions)
    if world == 1:
        return attention_rows(q_s, k_s, v_s, spec, 0)
    q, k, v = SeqToHeads.apply(group, octx, algo, q_s, k_s, v_s)
    ctx_h = attention_rows(q, k, v, spec, 0)  # [s, b, np/P*hn]
    ctx_h = ctx_h.view(s, q.shape[1], q.shape[2], q.shape[3])  # [s, b, np/P, hn]
    (ctx_s,) = HeadsToSeq.apply(group, octx, algo, ctx_h)
    return ctx_s.reshape(ctx_s.shape[0], ctx_s.shape[1], -1)  # [s/P, b, np*hn]
