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
One walk (`walk`; `Splits`: the split sizes of one call on one rank):
    ins[t]   [sum(in_splits), ...]   the tensors this rank sends (block d of rows for rank d)
    got      [sum(out_splits), ...]  the same tensors as they arrive (block s from rank s; own block read in place)
    outs[k]  [sum(in_splits), ...]   fn's outputs, back where the rows of ins came from (own block written in place)
    fn(key, blocks, counts) -> outputs of one block: key = (src, half); counts = rows per local expert
The own block is cut once, at `own_cut` rows (its half A runs first, half B last: schedules.expert_pipeline).
Transfers of zero rows are dropped from the schedule: both ends know every split, so both drop the same.
"exchange" / "reference": the unfused path: expert_all_to_all (pairwise / stock a2a), all rows sorted by
local expert through the experts at once, then the reverse exchange.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, NamedTuple, Sequence

import torch

from ...runtime import group_info, names_operator
from ...runtime.executor import execute
from ...schedules import Slice, Step, Transfer, expert_pipeline as pipeline_schedule
from ..registry import check_algo, forced, plain, register
from .exchange import COMBINE, DISPATCH, expert_all_to_all, offsets

OP = "expert_pipeline"
WORDS = "expert_all_to_all"  # the MoE words (config.MOE_ALGOS) are the exchange's


@dataclass(frozen=True)
class Splits:
    """The split sizes of one MoE layer call on one rank (group rank `rank` of `world`).
    counts[s][e]: rows of source rank s for local expert e (stock's num_global_tokens_per_local_expert)."""

    rank: int
    world: int
    in_splits: tuple[int, ...]
    counts: tuple[tuple[int, ...], ...]

    @property
    def out_splits(self) -> tuple[int, ...]:
        return tuple(sum(c) for c in self.counts)

    @property
    def own_cut(self) -> int:
        """Half A of the own block: its first half of the rows (rounded down)."""
        return self.out_splits[self.rank] // 2

    def chunk_counts(self, src: int, half: int) -> list[int]:
        """Rows per local expert of block src (half 0 = whole block, except the own block's halves)."""
        c = list(self.counts[src])
        if src != self.rank:
            return c
        first, left = [], self.own_cut
        for n in c:
            first.append(min(n, left))
            left -= first[-1]
        return first if half == 0 else [n - a for n, a in zip(c, first)]


@functools.lru_cache(maxsize=256)
def _steps(rank: int, world: int, ins: int, outs: int, sends_to: tuple, recvs_from: tuple) -> tuple[Step, ...]:
    """The schedule without transfers of zero rows: sends_to[d] (rows for d), recvs_from[s] (rows from s)."""
    def keep(t: Transfer, sending: bool) -> bool:
        dispatch = t.slice.tag < ins  # dispatch: peer gets / gives its tokens; combine: the reverse
        return (sends_to if dispatch == sending else recvs_from)[t.peer] > 0

    return tuple(Step(tuple(t for t in s.sends if keep(t, True)), tuple(t for t in s.recvs if keep(t, False)),
                      s.compute) for s in pipeline_schedule(rank, world, ins=ins, outs=outs).steps)


class _Pass:
    """The handler of every tag of one walk (tag < ins: a tensor in; ins <= tag < ins+outs: a tensor out)."""

    def __init__(self, splits: Splits, ins, out_like, fn: Callable):
        self.splits, self.ins, self.fn, self.n_in = splits, ins, fn, len(ins)
        self.xo, self.oo = offsets(splits.in_splits), offsets(splits.out_splits)
        rows_in = sum(splits.out_splits)
        self.got = [x.new_empty((rows_in,) + tuple(x.shape[1:])) for x in ins]
        self.outs = [like.new_empty(like.shape) for like in out_like]
        self.ready: dict[tuple[int, int], torch.Tensor] = {}

    def _rows(self, t: torch.Tensor, off: list[int], b: int) -> torch.Tensor:
        return t[off[b]:off[b + 1]]

    def send(self, x: Slice) -> torch.Tensor:
        if x.tag < self.n_in:  # my tokens for rank x.part
            return self._rows(self.ins[x.tag], self.xo, x.part)
        return self.ready.pop((x.block, x.tag))  # the output of rank x.block's block

    def recv(self, x: Slice) -> torch.Tensor:
        if x.tag < self.n_in:
            return self._rows(self.got[x.tag], self.oo, x.block)
        return self._rows(self.outs[x.tag - self.n_in], self.xo, x.part)

    def compute(self, x: Slice) -> None:
        src, r = x.block, self.splits.rank
        if src == r:
            return self._own(0 if x.tag == self.n_in else 1)
        if self.splits.out_splits[src] == 0:
            return None
        blocks = [self._rows(a, self.oo, src) for a in self.got]
        for k, y in enumerate(self.fn((src, 0), blocks, self.splits.chunk_counts(src, 0))):
            self.ready[(src, self.n_in + k)] = y.contiguous()
        return None

    def _own(self, half: int) -> None:
        """Half A (rows [0, cut)) or B (rows [cut, n)) of the own block: read from ins, written into outs."""
        base, n, cut = self.xo[self.splits.rank], self.splits.out_splits[self.splits.rank], self.splits.own_cut
        lo, hi = (base, base + cut) if half == 0 else (base + cut, base + n)
        if hi == lo:
            return
        own = self.splits.rank
        ys = self.fn((own, half), [t[lo:hi] for t in self.ins], self.splits.chunk_counts(own, half))
        for out, y in zip(self.outs, ys):
            out[lo:hi].copy_(y)

    def arrived(self, t: Transfer) -> None:
        pass


def walk(splits: Splits, group, ctx, ins: Sequence[torch.Tensor], out_like: Sequence[torch.Tensor],
         fn: Callable) -> list[torch.Tensor]:
    """Run one fused walk (module docstring) -> outs, laid out like ins."""
    ins = [t.contiguous() for t in ins]
    h = _Pass(splits, ins, out_like, fn)
    steps = _steps(splits.rank, splits.world, len(ins), len(out_like), splits.in_splits, splits.out_splits)
    execute(steps, group, {t: h for t in range(len(ins) + len(out_like) + 1)}, ctx)
    return h.outs


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
    def forward(fctx, splits, group, ctx, graphs, tokens, probs, *params):
        fctx.meta = (splits, group, ctx, graphs)
        fctx.like = (tokens.detach(), probs.detach())
        (y,) = walk(splits, group, ctx, [tokens.detach(), probs.detach()], [tokens.detach()], graphs.forward)
        return y

    @staticmethod
    def backward(fctx, dy):
        splits, group, ctx, graphs = fctx.meta
        dx, dp = walk(splits, group, ctx, [dy.contiguous()], list(fctx.like), graphs.backward)
        fctx.meta = fctx.like = None
        return (None, None, None, None, dx, dp, *graphs.summed())


@register(OP, "flash")
def pipeline_flash(tokens, probs, experts: LocalExperts, splits: Splits, group, ctx):
    """The fused walk (module docstring), differentiable in tokens, probs and the experts' params."""
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (tokens, probs, *experts.params))
    graphs = _Graphs(experts.fn, experts.params, keep=needs_grad)
    return _FusedExperts.apply(splits, group, ctx, graphs, tokens, probs, *experts.params)


def _by_expert(splits: Splits) -> torch.Tensor:
    """Row order that sorts the exchanged rows (by source, then local expert) by local expert, then source."""
    starts = offsets(splits.out_splits)
    order = []
    for e in range(len(splits.counts[0]) if splits.counts else 0):
        for s, c in enumerate(splits.counts):
            lo = starts[s] + sum(c[:e])
            order.extend(range(lo, lo + c[e]))
    return torch.tensor(order, dtype=torch.long)


def _unfused(a2a: str, tokens, probs, experts: LocalExperts, splits: Splits, group, ctx):
    """Exchange, all rows through the experts sorted by local expert (stock's sort), reverse exchange."""
    outs, ins = list(splits.out_splits), list(splits.in_splits)
    x = expert_all_to_all(tokens, outs, ins, group, ctx, algo=a2a, order=DISPATCH)
    p = expert_all_to_all(probs.unsqueeze(-1), outs, ins, group, ctx, algo=a2a, order=DISPATCH).squeeze(-1)
    idx = _by_expert(splits).to(x.device)
    totals = [sum(c[e] for c in splits.counts) for e in range(len(splits.counts[0]))]
    y_sorted = experts.fn(x[idx], totals, p[idx])
    y = torch.empty_like(y_sorted).index_copy(0, idx, y_sorted)  # back to the exchanged order
    return expert_all_to_all(y, ins, outs, group, ctx, algo=a2a, order=COMBINE)


@register(OP, "exchange")
def pipeline_exchange(tokens, probs, experts, splits, group, ctx):
    return _unfused("exchange", tokens, probs, experts, splits, group, ctx)


@register(OP, "reference")
def pipeline_reference(tokens, probs, experts, splits, group, ctx):
    return _unfused("reference", tokens, probs, experts, splits, group, ctx)


def _splits(tokens, probs, counts, input_splits, group) -> Splits:
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
    return Splits(rank, world, tuple(ins), tuple(tuple(c) for c in rows))


def expert_pipeline(tokens: torch.Tensor, probs: torch.Tensor, experts: LocalExperts, counts, input_splits, group,
                    ctx, *, algo: str = "flash") -> torch.Tensor:
    """The public wrapper: tokens [sum(input_splits), h], probs [sum(input_splits)] -> y [sum(input_splits), h];
    counts [P][E] (rows from each source rank per local expert; the exchanged row counts are their sums);
    experts: LocalExperts(fn, params) (the params' gradients are returned once); algo in config.MOE_ALGOS."""
    check_algo(WORDS, algo)
    splits = _splits(tokens, probs, counts, input_splits, group)
    if splits.world == 1:
        return experts.fn(tokens, list(splits.counts[0]), probs)
    return plain(OP, "reference" if forced() else algo)(tokens, probs, experts, splits, group, ctx)
