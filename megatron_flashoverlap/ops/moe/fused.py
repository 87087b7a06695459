"""The fused expert pipeline (expert-TP 1): dispatch, the local experts and combine as ONE pipelined exchange.

    tokens [sum(in_splits), h], probs [sum(in_splits)]  (the dispatcher's permuted order: block d for rank d)
      -> y [sum(in_splits), h]: each row through its expert on the rank that holds it, back in the same place
    experts = LocalExperts(fn, params): fn(x [n, h], counts [E], p [n]) -> [n, h], the local experts on rows
              grouped by local expert; params: every parameter fn uses (their gradients are returned once)
    counts[s][e]: rows of source rank s for local expert e (stock's num_global_tokens_per_local_expert)

"flash": one walk of schedules.expert_pipeline per pass. The block from source s (laid out by local
expert, counts[s]) runs through the experts as soon as it arrived, while the next block flies, and its
output goes back to s at the next step. The own block is split: half A first (under the first dispatch
hop), half B last (under the last combine hop), so neither end of the walk leaves a hop exposed:
    comm     | D r+1      | D r+2      | D r+3, C r-1 | ... | C r-P+2    | C r+1 (last output)
    compute  | own half A | block r-1  | block r-2    | ... | block r+1  | own half B
(Own tokens first on dispatch and own last on combine cannot both hold with one own block; with it whole,
either the first dispatch hop or the last combine hop would have nothing under it.)
Backward is the dual walk: dy blocks go to the ranks that made them, each block's expert backward runs on
arrival (torch.autograd.grad of that block's forward subgraph, kept from forward), dx and dprobs go back.
The expert parameters are inputs of the autograd Function: their per-block weight gradients are summed (in
fp32 for half-precision weights, rounded once) and returned ONCE, so a per-parameter grad hook (Megatron
DDP's) fires once. A linear with gradient_accumulation_fusion adds each block's dW into its fp32
main_grad itself and returns a dummy: that dummy is returned as is, once, and DDP skips it
(grad_added_to_main_grad), so main_grad holds the P per-block dW in one fp32 sum.
Numerics: every row is computed once by the same expert module, so forward rows and dx equal stock's up to
the GEMM kernel's blocking for a different row count; dW sums P+1 per-block GEMMs where stock runs one.
"exchange" / "reference": the unfused path: expert_all_to_all (pairwise / stock a2a), all rows sorted by
local expert through the experts at once, then the reverse exchange.
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import torch

from ...runtime import group_info, names_operator
from ..registry import check_algo, forced, plain, register
from .exchange import COMBINE, DISPATCH, expert_all_to_all, offsets
from .walk import Plan, walk

OP = "expert_pipeline"
WORDS = "expert_all_to_all"  # the MoE words (config.MOE_ALGOS) are the exchange's


class LocalExperts(NamedTuple):
    """This rank's experts: fn(x [n, h], counts [E], p [n]) -> [n, h], and every parameter fn uses."""
    fn: Callable
    params: Sequence[torch.Tensor]


class _Graphs:
    """Per-block forward subgraphs (key -> (leaves, out)) and the summed parameter gradients."""

    def __init__(self, experts: Callable, params: Sequence[torch.Tensor], keep: bool = True):
        self.experts, self.params, self.held, self.keep = experts, tuple(params), {}, keep
        self.grads: list[torch.Tensor | None] = [None] * len(self.params)

    def forward(self, key, blocks, counts):
        if not self.keep:  # no backward will come (inference): no subgraphs kept
            return (self.experts(blocks[0], counts, blocks[1]),)
        leaves = [b.detach().requires_grad_() for b in blocks]
        with torch.enable_grad():
            out = self.experts(leaves[0], counts, leaves[1])
        self.held[key] = (leaves, out)
        return (out.detach(),)

    def backward(self, key, blocks, counts):
        leaves, out = self.held.pop(key)
        got = torch.autograd.grad(out, leaves + list(self.params), blocks[0], allow_unused=True)
        for i, g in enumerate(got[2:]):
            self._add(i, g)
        return [g if g is not None else torch.zeros_like(x) for g, x in zip(got[:2], leaves)]

    def _add(self, i: int, g) -> None:
        p = self.params[i]
        if g is None:
            return
        if getattr(p, "grad_added_to_main_grad", False):  # fusion wrote main_grad: g is its dummy, pass it once
            self.grads[i] = g
            return
        g = g.float() if g.dtype in (torch.float16, torch.bfloat16) else g
        self.grads[i] = g if self.grads[i] is None else self.grads[i] + g

    def summed(self) -> list[torch.Tensor]:
        return [torch.zeros_like(p) if g is None else g.to(p.dtype) for g, p in zip(self.grads, self.params)]


@names_operator
class _FusedExperts(torch.autograd.Function):
    """forward y = combine(experts(dispatch(tokens, probs))) in one walk; backward the dual walk."""

    @staticmethod
    def forward(fctx, plan, group, ctx, graphs, tokens, probs, *params):
        fctx.meta = (plan, group, ctx, graphs)
        fctx.like = (tokens.detach(), probs.detach())
        (y,) = walk(plan, group, ctx, [tokens.detach(), probs.detach()], [tokens.detach()], graphs.forward)
        return y

    @staticmethod
    def backward(fctx, dy):
        plan, group, ctx, graphs = fctx.meta
        dx, dp = walk(plan, group, ctx, [dy.contiguous()], list(fctx.like), graphs.backward)
        fctx.meta = fctx.like = None
        return (None, None, None, None, dx, dp, *graphs.summed())


@register(OP, "flash")
def pipeline_flash(tokens, probs, experts: LocalExperts, plan: Plan, group, ctx):
    """The fused walk (module docstring), differentiable in tokens, probs and the experts' params."""
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (tokens, probs, *experts.params))
    graphs = _Graphs(experts.fn, experts.params, keep=needs_grad)
    return _FusedExperts.apply(plan, group, ctx, graphs, tokens, probs, *experts.params)


def _by_expert(plan: Plan) -> torch.Tensor:
    """Row order that sorts the exchanged rows (by source, then local expert) by local expert, then source."""
    starts = offsets(plan.out_splits)
    order = []
    for e in range(len(plan.counts[0]) if plan.counts else 0):
        for s, c in enumerate(plan.counts):
            lo = starts[s] + sum(c[:e])
            order.extend(range(lo, lo + c[e]))
    return torch.tensor(order, dtype=torch.long)


def _unfused(a2a: str, tokens, probs, experts: LocalExperts, plan: Plan, group, ctx):
    """Exchange, all rows through the experts sorted by local expert (stock's sort), reverse exchange."""
    outs, ins = list(plan.out_splits), list(plan.in_splits)
    x = expert_all_to_all(tokens, outs, ins, group, ctx, algo=a2a, order=DISPATCH)
    p = expert_all_to_all(probs.unsqueeze(-1), outs, ins, group, ctx, algo=a2a, order=DISPATCH).squeeze(-1)
    idx = _by_expert(plan).to(x.device)
    totals = [sum(c[e] for c in plan.counts) for e in range(len(plan.counts[0]))]
    y_sorted = experts.fn(x[idx], totals, p[idx])
    y = torch.empty_like(y_sorted).index_copy(0, idx, y_sorted)  # back to the exchanged order
    return expert_all_to_all(y, ins, outs, group, ctx, algo=a2a, order=COMBINE)


@register(OP, "exchange")
def pipeline_exchange(tokens, probs, experts, plan, group, ctx):
    return _unfused("exchange", tokens, probs, experts, plan, group, ctx)


@register(OP, "reference")
def pipeline_reference(tokens, probs, experts, plan, group, ctx):
    return _unfused("reference", tokens, probs, experts, plan, group, ctx)


def _plan(tokens, probs, counts, input_splits, group) -> Plan:
    rank, world = group_info(group)
    rows = [[int(n) for n in c] for c in (counts.tolist() if hasattr(counts, "tolist") else counts)]
    if len(rows) != world or len({len(c) for c in rows}) != 1 or min(min(c, default=0) for c in rows) < 0:
        raise ValueError(f"{OP}: counts must be [{world} source ranks][local experts] of sizes >= 0, got {rows}")
    ins = [int(n) for n in (input_splits.tolist() if hasattr(input_splits, "tolist") else input_splits)]
    if len(ins) != world or sum(ins) != tokens.shape[0]:
        raise ValueError(f"{OP}: input_splits {ins} must hold {world} sizes summing to the {tokens.shape[0]} "
                         f"token rows")
    if probs.shape != tokens.shape[:1]:
        raise ValueError(f"{OP}: probs {tuple(probs.shape)} must be [rows] = [{tokens.shape[0]}] (one per token row)")
    return Plan(rank, world, tuple(ins), tuple(tuple(c) for c in rows))


def expert_pipeline(tokens: torch.Tensor, probs: torch.Tensor, experts: LocalExperts, counts, input_splits, group,
                    ctx, *, algo: str = "flash") -> torch.Tensor:
    """The public wrapper: tokens [sum(input_splits), h], probs [sum(input_splits)] -> y [sum(input_splits), h];
    counts [P][E] (rows from each source rank per local expert; the exchanged row counts are their sums);
    experts: LocalExperts(fn, params) (the params' gradients are returned once); algo in config.MOE_ALGOS."""
    check_algo(WORDS, algo)
    plan = _plan(tokens, probs, counts, input_splits, group)
    if plan.world == 1:
        return experts.fn(tokens, list(plan.counts[0]), probs)
    return plain(OP, "reference" if forced() else algo)(tokens, probs, experts, plan, group, ctx)
