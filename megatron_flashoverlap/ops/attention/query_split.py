"""Query-split attention: core attention + output projection + reduce-scatter, one query block at a time.

    q [s, b, np/P, hn]    k, v [s, b, ng/P, hn]    w_proj [h, np/P*hn]    y_s [s/P, b, h]

    forward  y = RS(attn(q, k, v) @ w^T)
             the RS is Flash-RS (reduce_scatter_ring): step i produces the partial of output block
             d = r-1-i, i.e. ATTENTION of query rows d plus their projection, while the partial of the
             previous block flies; own block last. The hop hides behind attention, not only the GEMM:
                 comm    |        | hop d0 -> next | hop d1 -> next | ...
                 compute | attn(q[d0]) @ w | attn(q[d1]) @ w | ... | attn(q[r]) @ w
    backward (the dual): Flash-AG of dy (all_gather_ring, own shard first); each arrived dy block d
             recomputes attention of query rows d and gives
                 dw += dy_d^T ctx_d,   dctx_d = dy_d @ w,   (dq_d, dk += , dv += ) = attn_vjp(dctx_d)
             so no [b, np, s, s] probs tensor is kept between forward and backward.

Causal cost: block d sees (d + 1/2) * s/P keys on average, so step costs differ (block 0 is the cheapest);
a hop is exposed where it is slower than the block computed beside it. `exposed_hops` is the cost model:
for P = 4 and block costs 1, 3, 5, 7 (unit = cost of block 0), a hop of 2 units leaves 1 unit exposed, a hop
of 4 units 4 units (uniform blocks of 4 would hide both entirely). `zigzag=True` makes the blocks uniform:
block d = chunks (d, 2P-1-d) of 2P, each costing 4 units, so a hop is exposed only once it exceeds the
average block, as for non-causal attention.
dk, dv and dw are summed across blocks in fp32 for bf16/fp16. The RS sums are kept in fp32 and travel in
the wire dtype (`wire_dtype`: "input", stock's bytes, or "fp32"; runtime/numerics.py).
Registered as "query_split_attention" in ops/registry.py: the differentiable entry of each algo (the fused
autograd.Function for flash/flash_bidir; attention, then `matmul_reduce_scatter` for slicing/reference).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ...runtime import OverlapContext, acc_dtype, default_context, gather_and_consume, group_info
from ...runtime import check_wire, partial_linear, produce_and_scatter, wgrad, wire_dtype
from ...runtime.numerics import zeros_acc
from ..checks import check_divisible, peers_agree
from ..registry import plain, register, resolve
from ..tp_sp.functions import matmul_reduce_scatter
from .core import AttnSpec, attention_reference, attention_rows, check_attention_operands, make_spec
from .core import zigzag_positions

OP = "query_split_attention"


def query_split_ring(q, k, v, weight, group, ctx, spec: AttnSpec, bidirectional=False, wire="input"):
    """Plain forward (no autograd): y_s [s/P, b, h] with attention computed per RS block."""
    world = group_info(group)[1]

    def produce(span):
        return partial_linear(attention_rows(q[span[0]:span[1]], k, v, spec, span[0]), weight)  # [n, b, h]

    return produce_and_scatter(produce, q.shape[0] // world, (q.shape[1], weight.shape[0]), group, ctx,
                               acc_dtype=acc_dtype(q.dtype), out_dtype=q.dtype, device=q.device,
                               wire_dtype=wire_dtype(q.dtype, wire), bidirectional=bidirectional, name="qsa.rs")


def query_split_backward_ring(dy_s, q, k, v, weight, group, ctx, spec: AttnSpec, bidirectional=False):
    """-> (dq, dk, dv, dw): Flash-AG of dy_s [s/P, b, h], attention recomputed per arrived block."""
    dq = torch.empty_like(q)
    dk, dv, dw = zeros_acc(k), zeros_acc(v), zeros_acc(weight)
    k_, v_ = k.detach().requires_grad_(), v.detach().requires_grad_()

    def consume(span, dys):  # dys [n, b, h]: dy rows of query block span
        a, b = span
        q_ = q[a:b].detach().requires_grad_()
        with torch.enable_grad():
            c = attention_rows(q_, k_, v_, spec, a)  # recompute: [n, b, np*hn]
        dw.add_(wgrad(dys, c.detach()))
        gq, gk, gv = torch.autograd.grad(c, (q_, k_, v_), F.linear(dys, weight.t()))
        dq[a:b] = gq
        dk.add_(gk)
        dv.add_(gv)

    gather_and_consume(dy_s.contiguous(), consume, group, ctx, bidirectional=bidirectional, name="qsa.ag")
    return dq, dk.to(k.dtype), dv.to(v.dtype), dw.to(weight.dtype)


class QuerySplitAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, weight, group, octx, spec, bidirectional, wire):
        ctx.save_for_backward(q, k, v, weight)
        ctx.group, ctx.octx, ctx.spec, ctx.bidir = group, octx, spec, bidirectional
        return query_split_ring(q, k, v, weight, group, octx, spec, bidirectional, wire)

    @staticmethod
    def backward(ctx, dy):
        q, k, v, weight = ctx.saved_tensors
        dq, dk, dv, dw = query_split_backward_ring(dy, q, k, v, weight, ctx.group, ctx.octx, ctx.spec, ctx.bidir)
        return dq, dk, dv, dw, None, None, None, None, None


@register(OP, "flash")
@register(OP, "flash_bidir", bidirectional=True)
def _fused(q, k, v, weight, group, octx, spec, *, num_chunks=1, wire="input", bidirectional=False):
    return QuerySplitAttention.apply(q, k, v, weight, group, octx, spec, bidirectional, wire)


@register(OP, "slicing", algo="slicing")
@register(OP, "reference", algo="reference")
def _unfused(q, k, v, weight, group, octx, spec, *, num_chunks=1, wire="input", algo="reference"):
    """Full attention (plain autograd), then the GEMM + RS operator running `algo`."""
    ctx_full = attention_reference(q, k, v, spec)
    return matmul_reduce_scatter(ctx_full, weight, group, algo=algo, num_chunks=num_chunks, wire_dtype=wire,
                                 context=octx)


def query_split_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, weight: torch.Tensor, group=None, *,
                          causal: bool = True, attn_mask: torch.Tensor | None = None,
                          softmax_scale: float | None = None, dropout_p: float = 0.0, seed: int = 0,
                          algo: str = "flash", num_chunks: int | None = None, zigzag: bool = False,
                          wire_dtype: str = "input", context: OverlapContext | None = None) -> torch.Tensor:
    """y_s [s/P, b, h] = RS(attention(q, k, v) @ weight^T), with autograd.

    zigzag: balance causal work: the sequence is cut in 2P chunks and output block d is chunks (d, 2P-1-d)
    (every block then costs the same, see `causal_block_costs`), so y_s holds those rows: the layout of a
    model whose sequence-parallel shards are zigzag (tokens are permuted once at the input, positions kept).

    q [s, b, np/P, hn], k/v [s, b, ng/P, hn] (the full sequence, this rank's heads), weight [h, np/P*hn]
    (linear_proj's local shard), attn_mask bool [b|1, 1|np, s, s] (True = masked) OR-ed with `causal`.
    algo: "flash"/"flash_bidir" (query split in Flash-RS order), "slicing" (attention, then the sliced
    GEMM+RS baseline), "reference" (attention, GEMM, stock RS). Dropout masks are drawn per query row from
    (seed, row), so every algo and every P gives the same mask. wire_dtype: of the RS partials, "input" | "fp32"."""
    algo, num_chunks = resolve(OP, algo, num_chunks)
    check_wire(OP, wire_dtype)
    check_attention_operands(OP, q, k, v, weight)
    octx = context or default_context()
    rank, world = group_info(group)
    check_divisible(OP, q.shape[0], world)
    positions = None
    if zigzag and world > 1:  # rows in zigzag order; the causal rule and the mask follow the true positions
        positions = zigzag_positions(q.shape[0], world, q.device)
        q, k, v = (t.index_select(0, positions) for t in (q, k, v))
        if attn_mask is not None:
            attn_mask = attn_mask.index_select(-2, positions).index_select(-1, positions)
    spec = make_spec(q, causal, attn_mask, softmax_scale, dropout_p, seed, positions)
    peers_agree(OP, group, world, q.device, octx, *q.shape, *k.shape, *weight.shape)
    return plain(OP, algo if world > 1 else "reference")(q, k, v, weight, group, octx, spec, num_chunks=num_chunks,
                                                         wire=wire_dtype)

