"""A training step, stock Megatron beside --flash-overlap,
from one layer's times (layer_times.py) and the DP sync (dp.py).

    stage      one pipeline stage's micro-batch: layers/pp layers, the output layer (logits; as stock in both),
               and the pipeline send/receive of the activation and its gradient (exposed)
    step       (micro-batches + pp - 1) x stage (1F1B) + the DP sync's exposed time and backward growth + the
               optimizer (distributed Adam: OPT_BYTES per parameter of the rank's shard through HBM [est]); the
               parameter all-gather is taken as hidden (--overlap-param-gather)
    decode     one all-reduce of a decode token batch [1, b, h] over TP: NCCL's choice vs our best schedule,
               two per layer per token
Everything here is a PREDICTION of the model, never a measurement.
"""
from __future__ import annotations

from dataclasses import dataclass

from . import dp as DP
from . import ops
from .collectives import all_reduce, dp_ring
from .layer_times import LayerTimes, layer
from .links import place
from .model import Layout, Model, check
from .ops import OpTimes
from .price import Env

OPT_BYTES = 30  # [est] fp32 param, grad, two moments read; param, moments, bf16 copy written


@dataclass(frozen=True)
class StepTimes:
    model: Model
    layout: Layout
    layer: LayerTimes
    microbatches: int
    head: float
    p2p: float
    optimizer: float
    dp_stock: DP.DpTimes
    dp_ours: DP.DpTimes
    dp_fuse: bool
    decode: OpTimes | None

    def stage(self, stock: bool) -> float:
        return self.model.layers // self.layout.pp * self.layer.total(stock) + self.head + self.p2p

    def step(self, stock: bool) -> float:
        d = self.dp_stock if stock else self.dp_ours
        return ((self.microbatches + self.layout.pp - 1) * self.stage(stock) + d.exposed + d.extra
                + self.optimizer)


def _head(env: Env, model: Model, layout: Layout, tokens: int) -> float:
    """The output layer of one micro-batch (logits + cross entropy), as stock runs it."""
    g = place(layout.tp, 1, env.cluster)
    fwd, bwd = ops.column_fwd(env, g, tokens, model.hidden, model.vocab), ops.column_bwd(
        env, g, tokens, model.hidden, model.vocab)
    xent = env.gemm.elementwise(tokens * model.vocab / layout.tp * 4, 4.0)
    return fwd.time("reference") + bwd.time("reference") + 2 * xent


def _grads(env: Env, model: Model, lt: LayerTimes, layout: Layout, stock: bool) -> list[DP.Grad]:
    """The first stage's parameters in backward order (dp.py)."""
    tokens = model.seq // layout.cp * model.micro_batch
    numel = model.params_per_layer(layout.tp)
    dpg = place(layout.dp, layout.tp * layout.cp, env.cluster)
    one = [_grad(env, model, lt, layout, (name, tokens, numel, stock, dpg))  # every layer alike: priced once
           for name in ("fc2", "fc1", "attention", "proj", "qkv", "norms")]
    return one * (model.layers // layout.pp) + [DP.Grad("embedding", model.vocab // layout.tp * model.hidden, 0.0)]


def _grad(env: Env, model: Model, lt: LayerTimes, layout: Layout, what: tuple) -> DP.Grad:
    name, tokens, numel, stock, dpg = what
    if name == "attention":  # attention core, Ulysses and MoE backward; expert weights reduce over the expert-DP
        extra = sum(s.bwd("reference" if stock else s.variant) for s in lt.extras.values())  # group: not modelled
        return DP.Grad("attention", 0, lt.fixed_bwd + extra)
    if name not in lt.sites:
        return DP.Grad(name, numel.get(name, 0), 0.0)
    site = lt.sites[name]
    kind, m, k, n = model.sites(tokens)[name]
    rows, k_in = (n // layout.tp, k) if kind == "column" else (n, k // layout.tp)
    wgrad = env.mm(rows, tokens, k_in)
    return DP.Grad(name, rows * k_in, site.bwd("reference" if stock else site.variant) - wgrad, wgrad,
                   dp_ring(env, dpg, rows, k_in))


def plan_step(env: Env, model: Model, layout: Layout, decode_batch: int = 1, force: str | None = None) -> StepTimes:
    """Every number of the plan (module docstring); `force`: every TP site runs that algorithm (layer.sites)."""
    check(model, layout)
    if layout.world != env.cluster.world:
        raise ValueError(f"tp x pp x cp x dp = {layout.world} but the cluster has {env.cluster.world} GPUs "
                         f"({env.cluster.nodes} nodes x {env.cluster.gpus_per_node}); fix the sizes or --nodes")
    lt = layer(env, model, layout, force)
    tokens = model.seq // layout.cp * model.micro_batch
    n_mb = (model.global_batch or model.micro_batch * layout.dp) // (model.micro_batch * layout.dp)
    act = tokens * model.hidden * env.bytes / (layout.tp if layout.sequence_parallel else 1)
    pp = place(layout.pp, layout.tp * layout.cp * layout.dp, env.cluster)
    p2p = 2 * env.net.hop(act, act, pp.spans) if layout.pp > 1 else 0.0
    dpg = place(layout.dp, layout.tp * layout.cp, env.cluster)
    dp_stock = DP.sync(env, dpg, _grads(env, model, lt, layout, True), fused=False)
    ours = _grads(env, model, lt, layout, False)
    plain, fused = DP.sync(env, dpg, ours, fused=False), DP.sync(env, dpg, ours, fused=True)
    fuse = fused.exposed + fused.extra < (plain.exposed + plain.extra) * 0.999
    shard = sum(p.numel for p in ours) / layout.dp
    opt = env.gemm.elementwise(shard * OPT_BYTES, 1.0)
    tp = place(layout.tp, 1, env.cluster)
    decode = all_reduce(env, tp, decode_batch * model.hidden * env.bytes) if layout.tp > 1 else None
    return StepTimes(model, layout, lt, n_mb, _head(env, model, layout, tokens), p2p, opt, dp_stock,
                     fused if fuse else plain, fuse, decode)
