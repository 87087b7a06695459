"""The benchmarked blocks (TP with sequence parallel), built from the public operators, one per method.

    x_shard_s [s/P, b, h]
    MLP:        fc1  y1 [s, b, w] = AG(x) @ w1^T        (column, all_gather_matmul)
                     a  [s, b, w] = gelu(y1)
                fc2  y  [s/P, b, h] = RS(a @ w2^T)       (row, matmul_reduce_scatter)
    attention:  qkv  [s, b, 3w] = AG(x) @ wqkv^T         (w = local heads * head_dim)
                core o [s, b, w] = softmax(q k^T / sqrt(d)) v   per local head (no comm)
                proj y [s/P, b, h] = RS(o @ wo^T)
    MLP, TP without SP (mlp_nosp):  x [s, b, h] replicated
                fc1  y1 [s, b, w] = x @ w1^T              (column; backward: AR(dgrad), matmul_allreduce_dgrad)
                fc2  y  [s, b, h] = AR(gelu(y1) @ w2^T)   (row, matmul_all_reduce)

`w` is the per-rank inner width (ffn/P or heads/P * head_dim). The same block with w = 1 moves exactly
the same bytes with GEMMs shrunk to O(bytes moved): that is how `comm alone` is measured.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megatron_flashoverlap.ops import (OpPlan, all_gather_matmul, matmul_all_reduce, matmul_allreduce_dgrad,
                                       matmul_reduce_scatter)


@dataclass(frozen=True)
class Method:
    """One row of the table: an operator algo, its slicing chunk count, its sub-chunks per hop (flash only:
    None = the operators' automatic rule, ops/tp_sp/plain.py hop_chunks_for)."""

    name: str
    algo: str
    chunks: int | None = None
    hop_chunks: int | None = None


METHODS = (Method("stock", "reference"), Method("slicing k=2", "slicing", 2), Method("slicing k=4", "slicing", 4),
           Method("slicing k=8", "slicing", 8), Method("flash", "flash"), Method("flash c=2", "flash", hop_chunks=2),
           Method("flash c=4", "flash", hop_chunks=4), Method("flash_bidir", "flash_bidir"),
           Method("auto", "auto"))  # the layers' default (their chooser): Megatron rows only, operators have no auto


def operator_methods(methods) -> list:
    """The methods an operator block can run (every one but the layers' auto)."""
    return [m for m in methods if m.algo != "auto"]


def method_by_name(name: str) -> Method:
    for m in METHODS:
        if m.name == name:
            return m
    raise ValueError(f"unknown method {name!r}; choose among {[m.name for m in METHODS]}")


@dataclass(frozen=True)
class Shape:
    """seq: full sequence s; hidden h; width: per-rank inner width w; head_dim for the attention core."""

    seq: int
    batch: int
    hidden: int
    width: int
    head_dim: int = 64


class Block:
    """Weights of one block on this rank; `forward(x_shard, group, method, ctx, spans)` -> y_shard."""

    kind = "block"

    def __init__(self, shape: Shape, world: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.shape, self.world = shape, world
        h, w = shape.hidden, shape.width
        self.w_in = (torch.randn(self._in_width(w), h, generator=g) / h ** 0.5).requires_grad_()
        self.w_out = (torch.randn(h, w, generator=g) / w ** 0.5).requires_grad_()

    def _in_width(self, w: int) -> int:
        return w

    def params(self) -> list[torch.Tensor]:
        return [self.w_in, self.w_out]

    def input(self, seed: int = 1) -> torch.Tensor:
        s = self.shape
        g = torch.Generator().manual_seed(seed)
        return torch.randn(s.seq // self.world, s.batch, s.hidden, generator=g)  # x_shard_s [s/P, b, h]

    def _middle(self, y1: torch.Tensor) -> torch.Tensor:
        return F.gelu(y1)

    def forward(self, x_shard, group, method: Method, ctx, spans=None):
        kw = dict(plan=OpPlan(method.algo, method.chunks, method.hop_chunks), context=ctx)
        with _span(spans, "column AG+GEMM"):
            y1 = all_gather_matmul(x_shard, self.w_in, group, **kw)
        with _span(spans, "middle"):
            a = self._middle(y1)
        with _span(spans, "row GEMM+RS"):
            return matmul_reduce_scatter(a, self.w_out, group, **kw)


class MlpBlock(Block):
    kind = "mlp"


class AttentionBlock(Block):
    kind = "attn"

    def _in_width(self, w: int) -> int:
        return 3 * w

    def _middle(self, qkv: torch.Tensor) -> torch.Tensor:
        s, b, w3 = qkv.shape
        d = min(self.shape.head_dim, w3 // 3)
        q, k, v = (t.reshape(s, b, -1, d).permute(1, 2, 0, 3) for t in qkv.chunk(3, dim=-1))  # [b, heads, s, d]
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return o.permute(2, 0, 1, 3).reshape(s, b, -1)  # [b, heads, s, d] -> [s, b, w]


class NoSPMlpBlock(Block):
    """x [s, b, h] replicated -> column (n/P) -> gelu -> row -> y [s, b, h] replicated (module docstring); a
    method's `chunks` is the slicing k or the flash C sequence chunks."""

    kind = "mlp_nosp"

    def input(self, seed: int = 1) -> torch.Tensor:
        s = self.shape
        return torch.randn(s.seq, s.batch, s.hidden, generator=torch.Generator().manual_seed(seed))

    def forward(self, x, group, method: Method, ctx, spans=None):
        kw = dict(plan=OpPlan(method.algo, method.chunks), context=ctx)
        a = F.gelu(matmul_allreduce_dgrad(x, self.w_in, group, **kw))
        return matmul_all_reduce(a, self.w_out, group, **kw)


BLOCKS = {"mlp": MlpBlock, "attn": AttentionBlock, NoSPMlpBlock.kind: NoSPMlpBlock}


def make_block(kind: str, shape: Shape, world: int, seed: int = 0) -> Block:
    if kind not in BLOCKS:
        raise ValueError(f"unknown block {kind!r}; choose among {sorted(BLOCKS)}")
    return BLOCKS[kind](shape, world, seed)


def comm_only(shape: Shape) -> Shape:
    """The same transfers with GEMMs shrunk: inner width 1 (attention: one head of dim 1)."""
    return Shape(shape.seq, shape.batch, shape.hidden, 1, 1)


@contextlib.contextmanager
def _span(spans, label):
    """Record (label, start, end) into `spans` when it is a list."""
    t0 = time.perf_counter()
    yield
    if spans is not None:
        spans.append((label, t0, time.perf_counter()))
