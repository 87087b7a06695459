"""Ulysses with the projections fused into the all-to-all: QKV GEMM -> a2a -> attention -> a2a -> proj GEMM.

    x_s [s/P, b, h]   w_qkv [ng*(np/ng+2)*hn, h] (Megatron's linear_qkv layout: per kv group g, its np/ng
    query heads, then k, then v)   b_qkv [same rows] or None   w_proj [h, np*hn]   y_s [s/P, b, h]

    forward  produce (all_to_all_produce): step i computes the QKV projection of head group d = r+i+1
             (the rows of w_qkv of kv groups [d*ng/P, (d+1)*ng/P): contiguous) while the group of step i
             flies to its peer; the own group last, into its rows of the gathered tensor:
                 comm    |          | qkv_(r+1) -> r+1 | qkv_(r+2) -> r+2 | ...
                 compute | x@W_(r+1) | x@W_(r+2)        | x@W_(r+3)        | ... | x@W_r (own)
             attention of head group r over the full sequence (zigzag positions: Megatron's CP split)
             consume (all_to_all_consume): the own ctx piece first, then each arrived head group src is
             multiplied by the proj columns of group src and accumulated (fp32 for bf16/fp16):
                 comm    | ctx -> r+1 | ctx -> r+2 | ...
                 compute | acc += c_r @ Wp_r^T | acc += c_(r-1) @ Wp_(r-1)^T | ...
    backward the duals on the same two schedules, reversed in role:
             produce: dctx for head group d = dy_s @ Wp_d (sent to d), own last; dWp_d = dy_s^T ctx_s[group d]
             attention backward of head group r (graph kept from forward)
             consume: each arrived d(qkv) piece of group src gives dx += piece @ W_src, dW_src, db_src
Registered as "ulysses_fused_attention" in ops/registry.py: "flash" (UlyssesFused) and "reference"
(QKV GEMM, stock all_to_all, attention, stock all_to_all, proj GEMM), one signature, each given the call's
`FusedPlan`: the attention rule (AttnSpec) and the head layout of w_qkv (np query heads, ng kv groups).
RoPE is not applied inside (the fused path is for models whose positions enter elsewhere); the
Megatron-facing UlyssesDotProductAttention covers RoPE models (projections unfused).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from ...runtime import OverlapContext, acc_dtype, consume_all_to_all, default_context, group_info
from ...runtime import names_operator, produce_all_to_all, wgrad
from ...runtime.numerics import zeros_acc
from ..checks import peers_agree
from ..registry import plain, register, resolve_algo
from .core import CAUSAL, Attend, AttnSpec, attention_rows, make_spec, zigzag_positions
from .ulysses import check_ulysses_heads, ulysses_attention

OP = "ulysses_fused_attention"


class FusedPlan(NamedTuple):
    """One fused Ulysses call: which keys each row sees (spec), and this rank's np query heads / ng kv groups."""
    spec: AttnSpec
    heads: int
    groups: int


def _rows(n_rows: int, d: int, world: int) -> slice:
    n = n_rows // world
    return slice(d * n, (d + 1) * n)


def split_mixed(mixed: torch.Tensor, per_group: int, hn: int):
    """mixed [s, b, g, (per_group+2)*hn] -> q [s, b, g*per_group, hn], k, v [s, b, g, hn]."""
    s, b, g, _ = mixed.shape
    q, k, v = torch.split(mixed, [per_group * hn, hn, hn], dim=3)
    return q.reshape(s, b, g * per_group, hn), k, v


def join_mixed(dq, dk, dv, per_group: int) -> torch.Tensor:
    """The inverse layout of split_mixed: -> [s, b, g, (per_group+2)*hn]."""
    s, b, g, hn = dk.shape
    return torch.cat([dq.reshape(s, b, g, per_group * hn), dk, dv], dim=3)


def _forward(x_s, w_qkv, b_qkv, w_proj, group, octx, fp: FusedPlan):
    rank, world = group_info(group)
    heads, groups = fp.heads, fp.groups
    hn = w_proj.shape[1] // heads
    per_group, gl = heads // groups, groups // world

    def make(d):
        rows = _rows(w_qkv.shape[0], d, world)
        y = F.linear(x_s, w_qkv[rows], None if b_qkv is None else b_qkv[rows])
        return y.view(x_s.shape[0], x_s.shape[1], gl, -1)  # [s/P, b, ng/P, (np/ng+2)*hn]

    shape = (x_s.shape[0], x_s.shape[1], groups, (per_group + 2) * hn)
    (mixed,) = produce_all_to_all([make], [shape], x_s.dtype, x_s.device, group, octx)  # [s, b, ng/P, .]
    q, k, v = (t.detach().requires_grad_() for t in split_mixed(mixed, per_group, hn))
    with torch.enable_grad():
        ctx_h = attention_rows(q, k, v, fp.spec, 0)  # [s, b, np/P*hn]
    ctx_pieces = ctx_h.detach().view(ctx_h.shape[0], ctx_h.shape[1], heads // world, hn)
    acc = torch.zeros(x_s.shape[:2] + (w_proj.shape[0],), dtype=acc_dtype(x_s.dtype), device=x_s.device)
    ctx_s = torch.empty(x_s.shape[:2] + (w_proj.shape[1],), dtype=x_s.dtype, device=x_s.device)

    def use(src, piece):  # piece [s/P, b, np/P, hn]: this rank's rows, head group src
        flat = piece.reshape(piece.shape[0], piece.shape[1], -1)
        cols = _rows(w_proj.shape[1], src, world)
        ctx_s[:, :, cols] = flat
        acc.add_(F.linear(flat, w_proj[:, cols]))

    consume_all_to_all([ctx_pieces], [use], group, octx)
    return acc.to(x_s.dtype), (q, k, v, ctx_h, ctx_s)


def _backward(dy_s, inputs, saved, fp: FusedPlan, group, octx, has_bias):
    """inputs (x_s, w_qkv, w_proj); saved (q, k, v, ctx_h, ctx_s) from _forward."""
    rank, world = group_info(group)
    x_s, w_qkv, w_proj = inputs
    q, k, v, ctx_h, ctx_s = saved
    heads, groups = fp.heads, fp.groups
    acc = acc_dtype(x_s.dtype)
    dwp = zeros_acc(w_proj)

    def make(d):  # dctx of head group d for this rank's rows; dWp of group d as a side product
        cols = _rows(w_proj.shape[1], d, world)
        dwp[:, cols] = wgrad(dy_s, ctx_s[:, :, cols])
        return F.linear(dy_s, w_proj[:, cols].t()).view(dy_s.shape[0], dy_s.shape[1], heads // world, -1)

    shape = (dy_s.shape[0], dy_s.shape[1], heads, q.shape[3])
    (dctx_h,) = produce_all_to_all([make], [shape], dy_s.dtype, dy_s.device, group, octx)
    dq, dk, dv = torch.autograd.grad(ctx_h, (q, k, v), dctx_h.reshape(ctx_h.shape))
    dmixed = join_mixed(dq, dk, dv, heads // groups)  # [s, b, ng/P, (np/ng+2)*hn]
    dx, dw = zeros_acc(x_s), zeros_acc(w_qkv)
    db = torch.zeros(w_qkv.shape[0], dtype=acc, device=w_qkv.device) if has_bias else None

    def use(src, piece):  # piece [s/P, b, ng/P, .]: d(qkv) of head group src for this rank's rows
        rows = _rows(w_qkv.shape[0], src, world)
        flat = piece.reshape(piece.shape[0], piece.shape[1], -1)
        dx.add_(F.linear(flat, w_qkv[rows].t()))
        dw[rows] = wgrad(flat, x_s)
        if db is not None:
            db[rows] = flat.sum(dim=(0, 1))

    consume_all_to_all([dmixed.contiguous()], [use], group, octx)
    return dx.to(x_s.dtype), dw.to(w_qkv.dtype), None if db is None else db.to(w_qkv.dtype), dwp.to(w_proj.dtype)


@names_operator
class UlyssesFused(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_s, w_qkv, b_qkv, w_proj, fp, group, octx):
        y, saved = _forward(x_s, w_qkv, b_qkv, w_proj, group, octx, fp)
        ctx.saved = saved  # q, k, v are detached leaves with the attention graph: kept off save_for_backward
        ctx.save_for_backward(x_s, w_qkv, w_proj)
        ctx.fp, ctx.group, ctx.octx, ctx.has_bias = fp, group, octx, b_qkv is not None
        return y

    @staticmethod
    def backward(ctx, dy):
        dx, dw, db, dwp = _backward(dy.contiguous(), ctx.saved_tensors, ctx.saved, ctx.fp, ctx.group, ctx.octx,
                                    ctx.has_bias)
        ctx.saved = None
        return dx, dw, db, dwp, None, None, None


@register(OP, "flash")
def ulysses_fused_flash(x_s, w_qkv, b_qkv, w_proj, group, octx, fp: FusedPlan):
    return UlyssesFused.apply(x_s, w_qkv, b_qkv, w_proj, fp, group, octx)


@register(OP, "reference")
def ulysses_fused_reference(x_s, w_qkv, b_qkv, w_proj, group, octx, fp: FusedPlan):
    """Unfused, same signature: QKV GEMM, stock all_to_all, attention, stock all_to_all, proj GEMM."""
    spec, hn = fp.spec, w_proj.shape[1] // fp.heads
    mixed = F.linear(x_s, w_qkv, b_qkv).view(x_s.shape[0], x_s.shape[1], fp.groups, -1)
    q, k, v = split_mixed(mixed, fp.heads // fp.groups, hn)
    attend = Attend(causal=spec.causal, softmax_scale=spec.scale, zigzag=spec.positions is not None)
    return F.linear(ulysses_attention(q, k, v, group, attend=attend, algo="reference", context=octx), w_proj)


def ulysses_fused_attention(x_s: torch.Tensor, w_qkv: torch.Tensor, w_proj: torch.Tensor, group=None, *,
                            b_qkv: torch.Tensor | None = None, attend: Attend | None = None, algo: str = "flash",
                            context: OverlapContext | None = None) -> torch.Tensor:
    """y_s [s/P, b, h] = proj(Ulysses-attention(QKV(x_s))) over the CP `group`, with autograd.

    attend (core.Attend): heads (required): this tensor-parallel rank's query heads of w_qkv, divisible by P
    (its kv groups, also divisible by P, follow from w_qkv's rows); causal, softmax_scale, zigzag (default on:
    Megatron's CP split). No mask or dropout here. algo: "flash" (projections fused into the pairwise a2a
    steps) or "reference" (ulysses_fused_reference)."""
    algo = resolve_algo(OP, algo)
    attend = CAUSAL if attend is None else attend
    heads, groups = _layout(x_s, w_qkv, w_proj, attend)
    rank, world = group_info(group)
    check_ulysses_heads("ulysses_fused_attention", heads, groups, world)
    octx = context or default_context()
    peers_agree(OP, group, world, x_s.device, octx, *x_s.shape, *w_qkv.shape, *w_proj.shape, heads, groups)
    q_like = x_s.new_empty((1, 1, 1, w_proj.shape[1] // heads))
    positions = zigzag_positions(x_s.shape[0] * world, world, x_s.device) if attend.zigzagged(True) and world > 1 \
        else None
    fp = FusedPlan(make_spec(q_like, attend, None, positions), heads, groups)
    return plain(OP, algo if world > 1 else "reference")(x_s, w_qkv, b_qkv, w_proj, group, octx, fp)


def _layout(x_s, w_qkv, w_proj, attend: Attend) -> tuple[int, int]:
    """(np, ng) of w_qkv [ng*(np/ng+2)*hn, h] for np = attend.heads, hn = w_proj's columns / np; errors name
    the fix (a mask or dropout, which this operator does not take, too)."""
    if attend.heads is None or attend.mask is not None or attend.dropout_p:
        raise ValueError("ulysses_fused_attention: attend must give heads= (this rank's query heads of w_qkv) and "
                         "no mask or dropout (use ulysses_attention for those), e.g. attend=Attend(heads=8)")
    heads = attend.heads
    hn = w_proj.shape[1] // heads
    groups = (w_qkv.shape[0] // max(hn, 1) - heads) // 2 if heads and hn else 0
    if groups < 1 or heads % groups or w_qkv.shape != (groups * (heads // groups + 2) * hn, x_s.shape[-1]):
        raise ValueError(f"ulysses_fused_attention: w_qkv must be [ng*({heads}//ng+2)*{hn}, {x_s.shape[-1]}] "
                         f"(Megatron's linear_qkv layout) for {heads} query heads with ng kv groups dividing them; "
                         f"got {tuple(w_qkv.shape)} (w_proj {tuple(w_proj.shape)})")
    return heads, groups
