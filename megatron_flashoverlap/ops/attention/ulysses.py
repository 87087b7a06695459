"""Ulysses context-parallel core attention: sequence shards <-> head shards around a full-sequence attention.

    q_s [s/P, b, np, hn]   k_s, v_s [s/P, b, ng, hn]   (this rank's sequence shard, all its heads)
    ctx_s [s/P, b, np*hn]

    forward  (q, k, v)_h = seq->heads(q_s, k_s, v_s)      [s, b, np/P, hn]: one merged pairwise walk
             ctx_h = attention((q, k, v)_h)               full sequence, head group r
             ctx_s = heads->seq(ctx_h)                    [s/P, b, np, hn] -> [s/P, b, np*hn]
    backward the duals: heads->seq of dq/dk/dv, seq->heads of dctx (SeqToHeads / HeadsToSeq)
    algo     "flash" (pairwise steps on the executor) or "reference" (all_to_all_single): ULYSSES_ALGOS

The all-to-all, registered as "ulysses.seq_to_heads" / "ulysses.heads_to_seq": (tensors, group, ctx) -> tensors
    seq -> heads (before attention):  x_s [s/P, b, H, d]  ->  x_h [s, b, H/P, d]
    heads -> seq (after attention):   y_h [s, b, H/P, d]  ->  y_s [s/P, b, H, d]
"flash": runtime.produce_all_to_all / consume_all_to_all (pairwise steps on the one executor, own piece last /
first; several tensors in one merged walk, one tag per tensor); "reference": one blocking all_to_all_single per
tensor. SeqToHeads / HeadsToSeq are the autograd.Functions, each one's backward the other's forward (the dual).
Head group g = heads [g*H/P, (g+1)*H/P); the row block of rank src = rows [src*s/P, (src+1)*s/P).

Megatron's zigzag split (`get_batch_on_this_cp_rank`, 2P chunks, rank r holds chunks r and 2P-1-r):
the gathered rows are in rank order, not in sequence order. Attention is equivariant under a permutation
of rows as long as the causal rule uses the true positions, so nothing is reordered: the causal mask
compares `zigzag_positions` (RoPE was already applied per token before the a2a, with the same positions).
An explicit mask arrives as Megatron slices it: rows of this rank [B, 1, s/P, s] with keys in sequence
order; it is all-gathered over the group and its key columns are permuted to the gathered order.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from ...config import ULYSSES_ALGOS
from ...runtime import OverlapContext, consume_all_to_all, default_context, group_info, names_operator
from ...runtime import produce_all_to_all
from ..checks import peers_agree
from ..registry import plain, register, resolve_algo
from .core import CAUSAL, Attend, attention_rows, check_attention_operands, make_spec, zigzag_positions

__all__ = ["ULYSSES_ALGOS", "check_ulysses_heads", "gather_mask", "ulysses_attention"]

S2H, H2S = "ulysses.seq_to_heads", "ulysses.heads_to_seq"


def group_heads(t: torch.Tensor, g: int, world: int) -> torch.Tensor:
    """Head group g of t [.., H, d] along dim 2: [.., H/P, d]."""
    n = t.shape[2] // world
    return t[:, :, g * n:(g + 1) * n]


@register(S2H, "flash")
def seq_to_heads_flash(xs: Sequence[torch.Tensor], group, ctx) -> list[torch.Tensor]:
    """[s/P, b, H_i, d] each -> [s, b, H_i/P, d] each, in one walk (one tag per tensor)."""
    world = group_info(group)[1]
    makes = [lambda g, x=x: group_heads(x, g, world) for x in xs]
    return produce_all_to_all(makes, [tuple(x.shape) for x in xs], xs[0].dtype, xs[0].device, group, ctx)


@register(H2S, "flash")
def heads_to_seq_flash(ys: Sequence[torch.Tensor], group, ctx) -> list[torch.Tensor]:
    """[s, b, H_i/P, d] each -> [s/P, b, H_i, d] each, in one walk: piece src lands in head group src."""
    world = group_info(group)[1]
    outs = [torch.empty((y.shape[0] // world, y.shape[1], y.shape[2] * world) + tuple(y.shape[3:]),
                        dtype=y.dtype, device=y.device) for y in ys]

    def into(out):
        return lambda src, piece: group_heads(out, src, world).copy_(piece)

    consume_all_to_all(ys, [into(o) for o in outs], group, ctx)
    return outs


@register(S2H, "reference")
def seq_to_heads_reference(xs: Sequence[torch.Tensor], group, ctx) -> list[torch.Tensor]:
    """Stock: one blocking all_to_all_single per tensor."""
    return [_stock_seq_to_heads(x, group) for x in xs]


@register(H2S, "reference")
def heads_to_seq_reference(ys: Sequence[torch.Tensor], group, ctx) -> list[torch.Tensor]:
    """Stock: one blocking all_to_all_single per tensor."""
    return [_stock_heads_to_seq(y, group) for y in ys]


def _stock_seq_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """[s/P, b, H, d] -> [s, b, H/P, d]."""
    world = group_info(group)[1]
    send = torch.stack([group_heads(x, g, world) for g in range(world)]).contiguous()  # [P, s/P, b, H/P, d]
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv.reshape((-1,) + tuple(recv.shape[2:]))  # [P*s/P, b, H/P, d]


def _stock_heads_to_seq(y: torch.Tensor, group) -> torch.Tensor:
    """[s, b, H/P, d] -> [s/P, b, H, d]."""
    world = group_info(group)[1]
    recv = torch.empty_like(y)  # row block src = the piece of src: [P, s/P, b, H/P, d]
    dist.all_to_all_single(recv, y.contiguous(), group=group)
    return torch.cat(list(recv.view(world, -1, *y.shape[1:])), dim=2)  # head group src from src


def seq_to_heads(xs: Sequence[torch.Tensor], group, ctx, algo: str = "flash") -> list[torch.Tensor]:
    """[s/P, b, H_i, d] each -> [s, b, H_i/P, d] each (no autograd), by `algo` ("flash" or "reference")."""
    return plain(S2H, algo)(xs, group, ctx)


def heads_to_seq(ys: Sequence[torch.Tensor], group, ctx, algo: str = "flash") -> list[torch.Tensor]:
    """[s, b, H_i/P, d] each -> [s/P, b, H_i, d] each (no autograd), by `algo` ("flash" or "reference")."""
    return plain(H2S, algo)(ys, group, ctx)


@names_operator
class _AllToAll(torch.autograd.Function):
    """Forward one direction (`there`), backward the other (`back`) on the gradients: the dual."""

    @staticmethod
    def forward(ctx, there, back, group, octx, algo, *xs):
        ctx.back, ctx.group, ctx.octx, ctx.algo = back, group, octx, algo
        return tuple(there([x.contiguous() for x in xs], group, octx, algo))

    @staticmethod
    def backward(ctx, *dys):
        return (None,) * 5 + tuple(ctx.back([d.contiguous() for d in dys], ctx.group, ctx.octx, ctx.algo))


class SeqToHeads:
    """Forward seq -> heads; backward heads -> seq of the gradients. `apply(group, octx, algo, *xs)`."""

    @staticmethod
    def apply(group, octx, algo, *xs):
        return _AllToAll.apply(seq_to_heads, heads_to_seq, group, octx, algo, *xs)


class HeadsToSeq:
    """Forward heads -> seq; backward seq -> heads of the gradients. `apply(group, octx, algo, *ys)`."""

    @staticmethod
    def apply(group, octx, algo, *ys):
        return _AllToAll.apply(heads_to_seq, seq_to_heads, group, octx, algo, *ys)


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

    attend (core.Attend; default causal): mask, softmax scale, dropout (seed's masks) and zigzag: the shards follow
    Megatron's zigzag CP split (True, the default) or are contiguous (False).
    algo: "flash" (pairwise steps on the executor, q/k/v in one walk), "reference" (all_to_all_single)."""
    algo = resolve_algo("ulysses_attention", algo)
    attend = CAUSAL if attend is None else attend
    if attend.keep is not None:
        raise ValueError("ulysses_attention: attend.keep (a drawn mask of the whole sequence) is not supported: "
                         "no rank holds the whole sequence's heads before the all-to-all; give dropout a seed "
                         "(Attend(dropout_p=..., seed=...)) instead")
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
