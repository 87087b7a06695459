"""The model and the layout, as Megatron's arguments describe them, and the GEMM shapes they imply.

    Model   --hidden-size, --ffn-hidden-size, --num-attention-heads, --num-query-groups, --kv-channels,
            --seq-length, --micro-batch-size, --global-batch-size, --num-layers, --padded-vocab-size, --swiglu,
            --num-experts, --moe-router-topk, --moe-ffn-hidden-size, --recompute-granularity full
    Layout  --tensor/pipeline/context/expert-model-parallel-size, the data-parallel size, --sequence-parallel

Per TP site (M = tokens of one micro-batch on one CP rank = seq / cp * micro_batch; one transformer layer):
    qkv   column  K = hidden              N = (heads + 2 groups) * head_dim
    proj  row     K = heads * head_dim    N = hidden
    fc1   column  K = hidden              N = ffn (x 2 with SwiGLU)
    fc2   row     K = ffn                 N = hidden
Megatron's rank order tp-cp-ep-dp-pp places the groups (links.place): TP consecutive, CP `tp` apart, EP `tp`
apart (expert-TP 1 assumed: the expert weights whole on each EP rank), DP `tp * cp` apart.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Model:
    hidden: int
    ffn: int
    heads: int
    layers: int
    seq: int
    micro_batch: int = 1
    query_groups: int | None = None
    kv_channels: int | None = None
    vocab: int = 32000
    swiglu: bool = False
    experts: int = 0
    topk: int = 2
    moe_ffn: int | None = None
    global_batch: int | None = None
    recompute: bool = False

    def __post_init__(self):
        for name in ("hidden", "ffn", "heads", "layers", "seq", "micro_batch", "vocab"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.query_groups is not None and self.heads % self.query_groups:
            raise ValueError(f"--num-query-groups {self.query_groups} must divide --num-attention-heads {self.heads}")
        if self.kv_channels is None and self.hidden % self.heads:
            raise ValueError(f"--hidden-size {self.hidden} is not divisible by --num-attention-heads {self.heads}; "
                             f"pass --kv-channels")
        if self.experts and not 1 <= self.topk <= self.experts:
            raise ValueError(f"--moe-router-topk {self.topk} must be in [1, --num-experts {self.experts}]")

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden // self.heads

    @property
    def groups(self) -> int:
        return self.query_groups or self.heads

    @property
    def glu(self) -> int:
        return 2 if self.swiglu else 1

    def sites(self, tokens: int) -> dict[str, tuple[str, int, int, int]]:
        """site -> (kind, M, K, N) of one layer's TP GEMMs (module docstring); no fc1/fc2 with experts."""
        hd = self.head_dim
        out = {"qkv": ("column", tokens, self.hidden, (self.heads + 2 * self.groups) * hd),
               "proj": ("row", tokens, self.heads * hd, self.hidden)}
        if not self.experts:
            out["fc1"] = ("column", tokens, self.hidden, self.ffn * self.glu)
            out["fc2"] = ("row", tokens, self.ffn, self.hidden)
        return out

    def params_per_layer(self, tp: int) -> dict[str, int]:
        """Weights of one layer on one TP rank (elements), backward order; 'norms' are the small rest."""
        hd = self.head_dim
        out = {}
        if not self.experts:
            out["fc2"] = self.ffn * self.hidden // tp
            out["fc1"] = self.hidden * self.ffn * self.glu // tp
        out["proj"] = self.heads * hd * self.hidden // tp
        out["qkv"] = self.hidden * (self.heads + 2 * self.groups) * hd // tp
        out["norms"] = 4 * self.hidden
        return out


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    dp: int = 1
    sequence_parallel: bool = True

    def __post_init__(self):
        for name in ("tp", "pp", "cp", "ep", "dp"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} size must be >= 1, got {getattr(self, name)}")

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.cp * self.dp


def check(model: Model, layout: Layout) -> None:
    """ValueError naming the fix where Megatron (or our layers) would refuse the combination."""
    if model.layers % layout.pp:
        raise ValueError(f"--num-layers {model.layers} must be divisible by --pipeline-model-parallel-size {layout.pp}")
    if model.heads % (layout.tp * layout.cp) or model.groups % layout.tp:
        raise ValueError(f"--num-attention-heads {model.heads} and --num-query-groups {model.groups} must be divisible "
                         f"by tensor x context parallel sizes ({layout.tp} x {layout.cp})")
    if model.seq % (layout.tp * layout.cp * (2 if layout.cp > 1 else 1)):
        raise ValueError(f"--seq-length {model.seq} must be divisible by tp x cp (x 2 for the zigzag CP split)")
    if model.experts and (model.experts % layout.ep or (layout.dp * layout.cp) % layout.ep):
        raise ValueError(f"--num-experts {model.experts} must be divisible by --expert-model-parallel-size "
                         f"{layout.ep}, and ep must divide dp x cp")
    if layout.ep > 1 and not model.experts:
        raise ValueError("--expert-model-parallel-size > 1 needs --num-experts")
    if model.global_batch is not None and model.global_batch % (model.micro_batch * layout.dp):
        raise ValueError(f"--global-batch-size {model.global_batch} must be divisible by micro-batch x dp "
                         f"({model.micro_batch} x {layout.dp})")
