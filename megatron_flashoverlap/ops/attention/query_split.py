"""Query-split attention: core attention + output projection + reduce-scatter, one query block at a time.

    q [s, b, np/P, hn]    k, v [s, b, ng/P, hn]    w_proj [h, np/P*hn]    y_s [s/P, b, h]

    forward  y = RS(attn(q, k, v) @ w^T)
             the RS is Flash-RS (reduce_scatter_ring): step i produces the partial of output block
             d = r-1-i, i.e. ATTENTION of query rows d plus their projection, while the partial of the
             previous block flies; own block last. The hop hides behind attention, not only the GEMM:
                 comm    |        | hop d0 -> next | hop d1 -> next | ...
                 compute | attn(q[d0]) @ w | attn(q[d1]) @ w | ... | attn(q[r]) @ w
    backward (the dual): Flash-AG of dy (all_gather_ring, own shard first); each arrived dy block d gives
                 dw += dy_d^T ctx_d,   dctx_d = dy_d @ w,   (dq_d, dk += , dv += ) = attn_vjp(dctx_d)
             through the autograd graph the forward kept for block d (`Kept`: its probs and dropout mask,
             as stock's core attention keeps them for the whole sequence; k and v expanded to the query heads
             once, as Megatron repeats the groups once): no attention is recomputed. A forward without a
             backward to come (no grad, or none wanted) keeps nothing; a block the forward did not keep (a
             backward whose ring spans differ from the forward's) is recomputed from q, k, v.

Causal cost: block d sees (d + 1/2) * s/P keys on average, so step costs differ (block 0 is the cheapest);
a hop is exposed where it is slower than the block computed beside it. `exposed_hops` is the cost model:
for P = 4 and block costs 1, 3, 5, 7 (unit = cost of block 0), a hop of 2 units leaves 1 unit exposed, a hop
of 4 units 4 units (uniform blocks of 4 would hide both entirely). `Attend(zigzag=True)` makes the blocks
uniform: block d = chunks (d, 2P-1-d) of 2P, each costing 4 units, so a hop is exposed only once it exceeds
the average block, as for non-causal attention.
dk, dv and dw are summed across blocks in fp32 for bf16/fp16. The RS sums are kept in fp32 and travel in
the wire dtype (OpPlan.wire: "input", stock's bytes, or "fp32"; runtime/numerics.py).
Registered as "query_split_attention" in ops/registry.py: the differentiable entry of each algo (the fused
autograd.Function for flash/flash_bidir; attention, then `matmul_reduce_scatter` for slicing/reference),
each given the call's `QSPlan`: the attention rule (AttnSpec) and the OpPlan (algo, wire_dtype, slicing's chunks).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from ...runtime import OverlapContext, Producer, default_context, gather_and_consume, group_info
from ...runtime import names_operator, partial_linear, produce_and_scatter, sums, wgrad
from ...runtime.numerics import zeros_acc
from ..checks import check_divisible, peers_agree
from ..registry import OpPlan, plain, plan_of, register, resolve, ring_of
from ..tp_sp.autograd import matmul_reduce_scatter
from .core import CAUSAL, Attend, AttnSpec, attention_reference, attention_rows, check_attention_operands
from .core import expand_kv, make_spec, sum_kv_groups, zigzag_positions

OP = "query_split_attention"


class QSPlan(NamedTuple):
    """One query-split call as its Function carries it: which keys each row sees (spec), how it runs (plan),
    whether its forward keeps each block's attention graph for a backward to come (keep)."""
    spec: AttnSpec
    plan: OpPlan
    keep: bool = False


class Kept:
    """Each query block's attention graph, the forward's (kept) or the backward's (recomputed where not kept).

    k, v [s, b, ng, hn] as leaves; ke, ve [s, b, np, hn]: them expanded to the query heads once (k itself where
    ng = np); blocks {(a, b): (q rows leaf [n, b, np, hn], ctx rows [n, b, np*hn] with its graph)}."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, heads: int):
        self.k, self.v = k.detach().requires_grad_(), v.detach().requires_grad_()
        with torch.enable_grad():
            self.ke, self.ve = expand_kv(self.k, heads), expand_kv(self.v, heads)
        self.blocks: dict = {}

    def graph(self, q_rows: torch.Tensor, spec: AttnSpec, a: int) -> tuple:
        """(q rows leaf, ctx rows [n, b, np*hn] with its graph) of query rows [a, a+n)."""
        q_ = q_rows.detach().requires_grad_()
        with torch.enable_grad():
            return q_, attention_rows(q_, self.ke, self.ve, spec, a)

    def attend(self, q_rows: torch.Tensor, spec: AttnSpec, a: int) -> torch.Tensor:
        """ctx rows of query rows [a, a+n), their graph kept for `vjp`."""
        q_, c = self.blocks[(a, a + q_rows.shape[0])] = self.graph(q_rows, spec, a)
        return c.detach()

    def vjp(self, q: torch.Tensor, spec: AttnSpec, span: tuple, dctx: torch.Tensor) -> tuple:
        """(ctx rows, dq rows, dk part, dv part) of query rows span = (a, b) through the block's kept graph
        (then freed), else through one recomputed from q[a:b]."""
        a, b = span
        q_, c = self.blocks.pop((a, b), None) or self.graph(q[a:b], spec, a)
        gq, gk, gv = torch.autograd.grad(c, (q_, self.ke, self.ve), dctx)
        return c.detach(), gq, sum_kv_groups(gk, self.k.shape[2]), sum_kv_groups(gv, self.v.shape[2])


def query_split_ring(q, k, v, weight, group, ctx, qs: QSPlan, kept: Kept | None = None):
    """Plain forward (no autograd): y_s [s/P, b, h] with attention computed per RS block (into `kept`'s graphs
    where given)."""
    world = group_info(group)[1]

    def produce(span):
        rows = q[span[0]:span[1]]
        c = kept.attend(rows, qs.spec, span[0]) if kept is not None else attention_rows(rows, k, v, qs.spec, span[0])
        return partial_linear(c, weight)  # [n, b, h]

    block = (q.shape[0] // world, q.shape[1], weight.shape[0])  # [s/P, b, h]
    return produce_and_scatter(Producer(produce), block, sums(q.dtype, q.device, qs.plan.wire_dtype), group, ctx,
                               ring_of(qs.plan, "qsa.rs"))


def query_split_backward_ring(dy_s, q, weight, group, ctx, qs: QSPlan, kept: Kept):
    """-> (dq, dk, dv, dw): Flash-AG of dy_s [s/P, b, h], each arrived block through `kept`'s graph of it
    (recomputed where the forward kept none)."""
    dq = torch.empty_like(q)
    dk, dv, dw = zeros_acc(kept.k), zeros_acc(kept.v), zeros_acc(weight)

    def consume(span, dys):  # dys [n, b, h]: dy rows of query block span
        c, gq, gk, gv = kept.vjp(q, qs.spec, span, F.linear(dys, weight.t()))
        dw.add_(wgrad(dys, c))
        dq[span[0]:span[1]] = gq
        dk.add_(gk)
        dv.add_(gv)

    gather_and_consume(dy_s.contiguous(), consume, group, ctx, ring_of(qs.plan, "qsa.ag"))
    return dq, dk.to(kept.k.dtype), dv.to(kept.v.dtype), dw.to(weight.dtype)


@names_operator
class QuerySplitAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, weight, qs, group, octx):
        ctx.save_for_backward(q, k, v, weight)
        ctx.qs, ctx.group, ctx.octx = qs, group, octx
        ctx.kept = Kept(k, v, q.shape[2]) if qs.keep else None
        return query_split_ring(q, k, v, weight, group, octx, qs, ctx.kept)

    @staticmethod
    def backward(ctx, dy):
        q, k, v, weight = ctx.saved_tensors
        kept, ctx.kept = ctx.kept or Kept(k, v, q.shape[2]), None  # the graphs go with this backward
        dq, dk, dv, dw = query_split_backward_ring(dy, q, weight, ctx.group, ctx.octx, ctx.qs, kept)
        return dq, dk, dv, dw, None, None, None


@register(OP, "flash")
@register(OP, "flash_bidir")
def _fused(q, k, v, weight, group, octx, qs: QSPlan):
    keep = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, weight))  # a backward may come
    return QuerySplitAttention.apply(q, k, v, weight, qs._replace(keep=keep), group, octx)


@register(OP, "slicing")
@register(OP, "reference")
def _unfused(q, k, v, weight, group, octx, qs: QSPlan):
    """Full attention (plain autograd), then the GEMM + RS operator running the plan's algo."""
    ctx_full = attention_reference(q, k, v, qs.spec)
    return matmul_reduce_scatter(ctx_full, weight, group, plan=qs.plan, context=octx)


def query_split_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, weight: torch.Tensor, group=None, *,
                          attend: Attend | None = None, plan: OpPlan | None = None,
                          context: OverlapContext | None = None) -> torch.Tensor:
    """y_s [s/P, b, h] = RS(attention(q, k, v) @ weight^T), with autograd.

    q [s, b, np/P, hn], k/v [s, b, ng/P, hn] (the full sequence, this rank's heads), weight [h, np/P*hn]
    (linear_proj's local shard). attend (core.Attend; default causal): the mask, bool [b|1, 1|np, s, s]
    (True = masked) OR-ed with `causal`, the softmax scale and its precision, dropout (`keep`: a mask drawn
    for the whole sequence as stock's dropout draws it, each block applying its rows; else masks hashed per
    query row from (seed, row); either way every algo and every P gives the same mask) and zigzag: balance
    causal work: the sequence is cut in 2P chunks and output block d is chunks (d, 2P-1-d) (every block then
    costs the same, see `causal_block_costs`), so y_s holds those rows: the layout of a model whose
    sequence-parallel shards are zigzag (tokens are permuted once at the input, positions kept); default off.
    plan (ops/registry.py; default OpPlan("flash")): algo "flash"/"flash_bidir" (query split in Flash-RS order),
    "slicing" (attention, then the sliced GEMM+RS baseline, num_chunks), "reference" (attention, GEMM,
    stock RS); wire_dtype: of the RS partials, "input" | "fp32"."""
    plan = resolve(OP, plan_of(OP, None, plan))
    attend = CAUSAL if attend is None else attend
    check_attention_operands(OP, q, k, v, weight)
    octx = context or default_context()
    rank, world = group_info(group)
    check_divisible(OP, q.shape[0], world)
    positions, mask, keep = None, attend.mask, attend.keep
    if keep is not None and tuple(keep.shape) != (q.shape[1], q.shape[2], q.shape[0], k.shape[0]):
        raise ValueError(f"{OP}: attend.keep must be [b, np, sq, sk] = {[q.shape[1], q.shape[2], q.shape[0], k.shape[0]]}"
                         f" (this rank's heads, the whole sequence); got {list(keep.shape)}")
    if attend.zigzagged(False) and world > 1:  # rows in zigzag order; the causal rule, mask and keep follow
        positions = zigzag_positions(q.shape[0], world, q.device)  # the true positions
        q, k, v = (t.index_select(0, positions) for t in (q, k, v))
        mask, keep = (None if t is None else t.index_select(-2, positions).index_select(-1, positions)
                      for t in (mask, keep))
    qs = QSPlan(make_spec(q, attend, mask, positions, keep), plan)
    peers_agree(OP, group, world, q.device, octx, *q.shape, *k.shape, *weight.shape)
    return plain(OP, plan.algo if world > 1 else "reference")(q, k, v, weight, group, octx, qs)
