"""Extra rows: the real Megatron-Core MLP (TP=2, SP) from the stock local spec vs from our spec.

    stock Megatron MLP  = get_gpt_layer_local_spec().submodules.mlp   (blocking AG / RS in Megatron)
    ours, per method    = layer_spec(uniform(algo, num_chunks)).submodules.mlp
Only the block time is measured here (median and spread over repeats, max over ranks): Megatron's
groups come from parallel_state, so the fake-group "compute alone" does not apply to these rows.
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from .blocks import Method


def _build(config, mlp_spec, seed: int):
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.mlp import MLP

    from ..megatron.spec import submodules_of

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    return MLP(config=config, submodules=submodules_of(mlp_spec))  # 0.16 ModuleSpec or 0.19 partial


def _specs(methods):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from ..config import uniform
    from ..megatron.spec import layer_spec

    out = {"megatron stock": get_gpt_layer_local_spec().submodules.mlp}
    for m in methods:
        name = "ours: reference (blocking)" if m.algo == "reference" else f"ours: {m.name}"
        out[name] = layer_spec(uniform(m.algo, m.chunks)).submodules.mlp
    return out


def _time(mlp, x, dy, mode: str) -> float:
    xx = x.detach().requires_grad_(mode != "fwd")
    dist.barrier()
    t0 = time.perf_counter()
    y, _ = mlp(xx)
    if mode != "fwd":
        y.backward(dy)
    dt = time.perf_counter() - t0
    mlp.zero_grad(set_to_none=True)
    return dt


def measure_megatron(seq: int, batch: int, hidden: int, width: int, methods: list[Method], repeats: int) -> list[dict]:
    """Rows {kind: "megatron mlp", seq, method, mode, block, spread} (rank-max per repeat, then median)."""
    from ..megatron.models import destroy, init_tp, tiny_config

    world = dist.get_world_size()
    init_tp(world)
    try:
        # heads: unused by the MLP, but TransformerConfig wants them divisible by TP
        config = tiny_config(world, True, num_layers=1, hidden=hidden, heads=2 * world,
                             ffn=width * world, add_bias_linear=False)
        mlps = {name: _build(config, spec, seed=11) for name, spec in _specs(methods).items()}
        g = torch.Generator().manual_seed(5)
        x = torch.randn(seq // world, batch, hidden, generator=g)  # x_shard_s [s/P, b, h]
        dy = torch.randn(seq // world, batch, hidden, generator=g)
        samples: dict = {}
        for r in range(repeats + 1):
            for name, mlp in mlps.items():
                for mode in ("fwd", "fwd+bwd"):
                    t = _time(mlp, x, dy, mode)
                    if r > 0:
                        samples.setdefault((name, mode), []).append(t)
    finally:
        destroy()
    return _rows(samples, seq)


def _rows(samples: dict, seq: int) -> list[dict]:
    out = []
    for (name, mode), mine in samples.items():
        ts = torch.tensor(mine, dtype=torch.float64)
        dist.all_reduce(ts, op=dist.ReduceOp.MAX)
        vals = ts.tolist()
        out.append({"kind": "megatron mlp", "seq": seq, "method": name, "mode": mode,
                    "block": statistics.median(vals), "spread": (min(vals), max(vals))})
    return out
