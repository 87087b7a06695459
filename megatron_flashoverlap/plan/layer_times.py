"""One transformer layer of one micro-batch: the TP sites, attention, Ulysses, MoE; stock beside each choice.

    site time   forward (twice with --recompute-granularity full) + backward of the site's operator (ops.py)
    attention   causal flash attention: forward 2 b s^2 (heads/tp/cp) d FLOPs, backward 2.5x that, at ATTN_EFF
                of the matrix peak [est]; unchanged by the planner
    elementwise norms, residual adds, bias-dropout-adds, the activation, rotary: NORM_PASSES passes over the
                hidden-sized activation (a tp-th of it with SP), ACT_PASSES over the FFN activation [est]
    ulysses     cp > 1: the q, k, v and context all-to-alls, forward and backward (collectives.ulysses)
    moe         experts > 0: dispatch, experts, combine, forward and backward (collectives.moe); the dense
                fc1/fc2 sites are then absent
TP without SP (`sequence_parallel=False`): column sites all-reduce their dgrad (collectives.ar_bwd), row sites
all-reduce their output (ar_fwd); the chunk count C of flash is one setting (all_reduce.num_chunks), so one C is
chosen for every site.
"""
from __future__ import annotations

from dataclasses import dataclass

from . import collectives as CL
from . import ops
from .links import place
from .model import Layout, Model
from .ops import OpTimes, combine
from .price import Env
from .walk import Clock

ATTN_EFF = 0.55  # [est] flash attention's fraction of the matrix peak
NORM_PASSES, ACT_PASSES = 14, 3  # [est]


@dataclass(frozen=True)
class Site:
    name: str
    op: OpTimes  # forward (x recompute) + backward
    fwd: OpTimes
    variant: str  # the chosen variant ("reference", "slicing:4", "flash:1", ...)
    runs_fwd: int = 1  # forward passes in `op` (2 with full recompute)

    def bwd(self, variant: str) -> float:
        """Seconds of the backward alone in `variant`."""
        return self.op.times[variant] - self.runs_fwd * self.fwd.times[variant]

    @property
    def algo(self) -> str:
        return self.variant.split(":")[0]

    @property
    def time(self) -> float:
        return self.op.times[self.variant]

    @property
    def stock(self) -> float:
        return self.op.times["reference"]


@dataclass(frozen=True)
class LayerTimes:
    sites: dict
    fixed: float  # attention + elementwise, forward + backward (+ recompute)
    fixed_bwd: float  # their backward alone
    extras: dict  # "ulysses" / "moe": Site

    def total(self, stock: bool) -> float:
        parts = list(self.sites.values()) + list(self.extras.values())
        return self.fixed + sum(s.stock if stock else s.time for s in parts)


def _local(name: str, seconds: float, keys) -> OpTimes:
    """A GEMM with no communication: the same time in every variant."""
    def replay() -> Clock:
        return Clock(t=seconds, events=[("compute", 0.0, seconds, name)])
    return OpTimes(name, seconds, 0.0, 0.0, {k: seconds for k in keys}, seconds, {k: replay for k in keys})


def _site_op(env: Env, model: Model, layout: Layout, spec: tuple) -> tuple[OpTimes, OpTimes]:
    kind, m, k, n = spec
    g = place(layout.tp, 1, env.cluster)
    if layout.sequence_parallel:
        fwd = (ops.column_fwd if kind == "column" else ops.row_fwd)(env, g, m, k, n)
        bwd = (ops.column_bwd if kind == "column" else ops.row_bwd)(env, g, m, k, n)
    elif kind == "column":
        bwd = CL.ar_bwd(env, g, m, k, n)
        fwd = _local("matmul", env.mm(m, k, n / g.size), bwd.times)
    else:
        fwd = CL.ar_fwd(env, g, m, k, n)
        bwd = _local("matmul.backward", env.mm(m, n, k / g.size) + env.mm(k / g.size, m, n), fwd.times)
    runs = [fwd, fwd, bwd] if model.recompute else [fwd, bwd]
    return combine(f"{fwd.name}+backward", runs), fwd


def _choose(op: OpTimes, allowed=None, force: str | None = None) -> str:
    if op.comm <= 0:  # a group of one: nothing to overlap
        return "reference"
    keys = [v for v in op.times if allowed is None or v.split(":")[0] != "flash" or v in allowed]
    if force is not None and any(v.split(":")[0] == force for v in keys):
        keys = [v for v in keys if v.split(":")[0] == force]
    best = min(op.times[v] for v in keys)
    for algo in ops.ALGO_ORDER:  # the simplest algorithm within 0.1 % of the fastest (a tie is no reason)
        mine = [v for v in keys if v.split(":")[0] == algo and op.times[v] <= best * 1.001]
        if mine:
            return min(mine, key=op.times.get)
    raise AssertionError("no variant")


def sites(env: Env, model: Model, layout: Layout, tokens: int, force: str | None = None) -> dict[str, Site]:
    """The TP sites; `force` an algorithm (its best variant) instead of the fastest (validation: async-TP)."""
    pairs = {name: _site_op(env, model, layout, spec) for name, spec in model.sites(tokens).items()}
    allowed = None
    if not layout.sequence_parallel and layout.tp > 1:  # one chunk count C for every site
        flashes = {v for op, _ in pairs.values() for v in op.times if v.startswith("flash:")}
        allowed = {min(flashes, key=lambda v: sum(op.times.get(v, 1e9) for op, _ in pairs.values()))}
    runs = 2 if model.recompute else 1
    return {name: Site(name, op, fwd, _choose(op, allowed, force), runs) for name, (op, fwd) in pairs.items()}


def fixed_time(env: Env, model: Model, layout: Layout, tokens: int) -> tuple[float, float]:
    """(forward + backward (+ recompute), backward alone) of one layer's attention core and elementwise work."""
    heads = model.heads / (layout.tp * layout.cp)
    attn_f = 2.0 * model.micro_batch * model.seq ** 2 * heads * model.head_dim / (
        env.cluster.gpu.peak(env.act_dtype) * ATTN_EFF)  # the core attention stays in bf16 under FP8
    rows = tokens / (layout.tp if layout.sequence_parallel else 1)
    ffn = model.moe_ffn or model.ffn
    moved = (NORM_PASSES * rows * model.hidden + ACT_PASSES * tokens * ffn * model.glu / layout.tp) * env.bytes
    elem_f = env.gemm.elementwise(moved, 1.0) + 12 * env.gemm.kernel
    cast_f, cast_b = _fp8_casts(env, model, layout, tokens)  # FP8: a forward's casts (again when recomputed)
    bwd = 2.5 * attn_f + 2 * elem_f + cast_b
    return (attn_f + elem_f + cast_f) * (2 if model.recompute else 1) + bwd, bwd


def _fp8_casts(env: Env, model: Model, layout: Layout, tokens: int) -> tuple[float, float]:
    """(forward, backward) seconds of one layer's FP8 casts on a rank: each TP GEMM's input and weight once per
    forward, its output gradient once per backward (0 without FP8; the same in both arms)."""
    sp = layout.tp if layout.sequence_parallel else 1
    fwd = bwd = 0.0
    for kind, m, k, n in model.sites(tokens).values():
        x = m * k / (sp if kind == "column" else layout.tp)  # a column's SP shard, a row's K shard
        dy = m * n / (layout.tp if kind == "column" else sp)
        fwd, bwd = fwd + env.cast(x) + env.cast(k * n / layout.tp), bwd + env.cast(dy)
    return fwd, bwd


def extras(env: Env, model: Model, layout: Layout, tokens: int) -> dict[str, Site]:
    out = {}
    runs = 3 if model.recompute else 2
    if layout.cp > 1:
        g = place(layout.cp, layout.tp, env.cluster)
        rows, hd, b = tokens, model.head_dim, env.bytes
        q = rows * model.heads / layout.tp * hd * b
        kv = rows * model.groups / layout.tp * hd * b
        before = CL.ulysses(env, g, [q, kv, kv])
        after = CL.ulysses(env, g, [q])
        op = combine("ulysses", [before, after] * runs)
        out["ulysses"] = Site("ulysses", op, combine("ulysses", [before, after]), _choose(op), runs - 1)
    if model.experts:
        g = place(layout.ep, layout.tp, env.cluster)
        per_rank = tokens / (layout.tp if layout.sequence_parallel else 1)
        dims = (model.hidden, model.moe_ffn or model.ffn, model.glu)
        exp = (model.experts // layout.ep, model.topk)
        fwd = CL.moe(env, g, per_rank, dims, exp)
        op = combine("moe", [fwd] * (runs - 1) + [CL.moe(env, g, per_rank, dims, exp, backward=True)])
        out["moe"] = Site("moe", op, fwd, _choose(op), runs - 1)
    return out


def layer(env: Env, model: Model, layout: Layout, force: str | None = None) -> LayerTimes:
    tokens = model.seq // layout.cp * model.micro_batch
    return LayerTimes(sites(env, model, layout, tokens, force), *fixed_time(env, model, layout, tokens),
                      extras(env, model, layout, tokens))
