"""Attention blocks for the benchmark harness (megatron_flashoverlap/bench): the same duck-typed protocol as
benchmarks/harness/blocks.py `Block` (ctor (shape, world, seed), kind, params(), input(seed), forward(x_shard, group,
method, ctx, spans)); this module does not import the harness. Register with
`harness.blocks.BLOCKS.update(ATTENTION_BLOCKS)`.

    "qsa"      TP + SP attention block, x_shard_s [s/P, b, h] -> y_s [s/P, b, h]:
               qkv = AG(x) @ Wqkv^T (all_gather_matmul), then core attention + proj + RS as ONE operator,
               query_split_attention: method "flash"/"flash_bidir" = query split in Flash-RS order (the RS
               hides behind attention), "stock" = attention then GEMM then stock RS, "slicing k" =
               attention then the sliced GEMM+RS. width w = local heads * head_dim (heads = w // head_dim).
    "qsa_zigzag" the same with zigzag-balanced causal blocks (every RS block the same attention work).
    "ulysses"  CP (Ulysses) attention block, x_s [s/P, b, h] -> y_s [s/P, b, h], no TP: width w = all heads *
               head_dim (heads divisible by P). method "flash" = ulysses_fused_attention (QKV / proj GEMMs
               inside the pairwise a2a steps), "stock" = QKV GEMM, all_to_all_single, attention,
               all_to_all_single, proj GEMM. Other methods: ValueError.
Communication alone for "ulysses": its a2a bytes scale with w, so the harness's width-1 trick does not
apply; `UlyssesBlock.comm_alone(x, group, method, ctx)` runs the two exchanges with the same bytes and no
GEMM or attention.
"""
from __future__ import annotations

import time

import torch

from megatron_flashoverlap.runtime import OverlapContext
from megatron_flashoverlap.ops import Attend, OpPlan
from megatron_flashoverlap.ops.attention.query_split import query_split_attention
from megatron_flashoverlap.ops.tp_sp.autograd import all_gather_matmul
from megatron_flashoverlap.ops.attention.ulysses import heads_to_seq, seq_to_heads
from megatron_flashoverlap.ops.attention.ulysses_fused import ulysses_fused_attention


class _Span:
    def __init__(self, spans, label):
        self.spans, self.label = spans, label

    def __enter__(self):
        self.t0 = time.perf_counter()

    def __exit__(self, *exc):
        if self.spans is not None:
            self.spans.append((self.label, self.t0, time.perf_counter()))


class QuerySplitBlock:
    kind = "qsa"
    zigzag = False

    def __init__(self, shape, world: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.shape, self.world = shape, world
        self.head_dim = max(1, min(shape.head_dim, shape.width))
        self.heads = max(1, shape.width // self.head_dim)
        w, h = self.heads * self.head_dim, shape.hidden
        self.w_in = (torch.randn(3 * w, h, generator=g) / h ** 0.5).requires_grad_()  # [3w, h]: q | k | v
        self.w_out = (torch.randn(h, w, generator=g) / w ** 0.5).requires_grad_()

    def params(self) -> list[torch.Tensor]:
        return [self.w_in, self.w_out]

    def input(self, seed: int = 1) -> torch.Tensor:
        s = self.shape
        return torch.randn(s.seq // self.world, s.batch, s.hidden, generator=torch.Generator().manual_seed(seed))

    def forward(self, x_shard, group, method, ctx: OverlapContext, spans=None):
        kw = dict(plan=OpPlan(method.algo, method.chunks), context=ctx)
        with _Span(spans, "column AG+GEMM"):
            qkv = all_gather_matmul(x_shard, self.w_in, group, **kw)  # [s, b, 3w]
        q, k, v = (t.reshape(t.shape[0], t.shape[1], self.heads, self.head_dim) for t in qkv.chunk(3, dim=-1))
        with _Span(spans, "attention+proj+RS"):
            return query_split_attention(q, k, v, self.w_out, group, attend=Attend(zigzag=self.zigzag), **kw)


class ZigzagQuerySplitBlock(QuerySplitBlock):
    """"qsa" with zigzag-balanced causal blocks (sequence divisible by 2P; the SP layout is zigzag)."""

    kind = "qsa_zigzag"
    zigzag = True


class UlyssesBlock:
    kind = "ulysses"

    def __init__(self, shape, world: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.shape, self.world = shape, world
        self.head_dim = max(1, min(shape.head_dim, shape.width))
        self.heads = shape.width // self.head_dim
        if self.heads < 1 or self.heads % world:
            raise ValueError(f"ulysses block: width {shape.width} / head_dim {self.head_dim} = {self.heads} heads; "
                             f"choose a width that gives a multiple of {world} heads")
        w, h = self.heads * self.head_dim, shape.hidden
        self.w_in = (torch.randn(3 * w, h, generator=g) / h ** 0.5).requires_grad_()  # per head: q, k, v
        self.w_out = (torch.randn(h, w, generator=g) / w ** 0.5).requires_grad_()

    params = QuerySplitBlock.params
    input = QuerySplitBlock.input

    @staticmethod
    def _algo(method) -> str:
        if method.algo not in ("flash", "reference"):
            raise ValueError(f"ulysses block: method {method.name!r} does not apply; use 'stock' or 'flash'")
        return method.algo

    def forward(self, x_s, group, method, ctx: OverlapContext, spans=None):
        with _Span(spans, "qkv+a2a+attention+a2a+proj"):
            return ulysses_fused_attention(x_s, self.w_in, self.w_out, group, attend=Attend(heads=self.heads),
                                           algo=self._algo(method), context=ctx)

    def comm_alone(self, x_s, group, method, ctx: OverlapContext):
        """The block's two exchanges (q/k/v seq->heads, ctx heads->seq), same bytes, no compute."""
        s, b = x_s.shape[0], x_s.shape[1]
        qkv = x_s.new_zeros(s, b, self.heads, 3 * self.head_dim)  # per head: q, k, v
        algo = self._algo(method)
        (h,) = seq_to_heads([qkv], group, ctx, algo)
        return heads_to_seq([h[..., :self.head_dim].contiguous()], group, ctx, algo)[0]


ATTENTION_BLOCKS = {"qsa": QuerySplitBlock, "qsa_zigzag": ZigzagQuerySplitBlock, "ulysses": UlyssesBlock}
