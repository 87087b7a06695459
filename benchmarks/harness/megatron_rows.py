"""Extra rows: the real Megatron-Core MLP (TP=2, SP) from the stock local spec vs from our spec.

    stock Megatron MLP  = get_gpt_layer_local_spec().submodules.mlp   (blocking AG / RS in Megatron)
    ours, per method    = layer_spec(uniform(algo, num_chunks)).submodules.mlp
Only the block time is measured here (median and spread over repeats, max over ranks): Megatron's
groups come from parallel_state, so the fake-group "compute alone" does not apply to these rows.
"""
from __future__ import annotations

import statistics

import torch
import torch.distributed as dist

from benchmarks.harness.blocks import Method
from megatron_flashoverlap.runtime.timing import interleaved, pass_seconds, rank_max, timed


def _build(config, mlp_spec, seed: int):
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.mlp import MLP

    from megatron_flashoverlap.megatron.spec import submodules_of

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    return MLP(config=config, submodules=submodules_of(mlp_spec))  # 0.16 ModuleSpec or 0.19 partial


AUTO = "ours: auto"  # the row of the layers' default (_specs names it)
# The CPU proxy's paired rounds of one linear's forward + backward take seconds (5 rounds, two candidates, ~5 s a
# site at s 2048, h 1024), where a GPU's take milliseconds: the default budget (10 s) would leave the second
# linear to the model (stock). The row measures both, as a GPU run would inside its default budget.
AUTO_BUDGET_S = 60.0


def _specs(methods):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_flashoverlap.config import from_dict, uniform
    from megatron_flashoverlap.megatron.spec import layer_spec

    out = {"megatron stock": get_gpt_layer_local_spec().submodules.mlp}
    for m in methods:
        name = "ours: reference (blocking)" if m.algo == "reference" else f"ours: {m.name}"
        cfg = from_dict({"default": {"algo": "auto"}, "choices": {"budget_s": AUTO_BUDGET_S}}) if name == AUTO \
            else uniform(m.algo, m.chunks)
        out[name] = layer_spec(cfg).submodules.mlp
    return out


def _time(mlp, x, dy, mode: str) -> float:
    return pass_seconds(lambda xx: mlp(xx)[0], x, mode, dy, list(mlp.parameters()))  # mlp -> (output, bias)


def measure_megatron(seq: int, batch: int, hidden: int, width: int, methods: list[Method], repeats: int) -> list[dict]:
    """Rows {kind: "megatron mlp", seq, method, mode, block, spread} (rank-max per repeat, then median)."""
    from megatron_flashoverlap.megatron.models import destroy, init_tp, tiny_config

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
        variants = {(name, mode): (lambda mlp=mlp, mode=mode: _time(mlp, x, dy, mode))
                    for name, mlp in mlps.items() for mode in ("fwd", "fwd+bwd")}
        samples = rank_max(interleaved(variants, repeats))  # an auto MLP decides in the warm-up round
        picked = {AUTO: _picked(mlps[AUTO])} if AUTO in mlps else {}
    finally:
        destroy()
    return [{"kind": "megatron mlp", "seq": seq, "method": name, "mode": mode, "block": statistics.median(vals),
             "spread": (min(vals), max(vals)), "samples": list(vals),
             **({"picked": picked[name]} if name in picked else {})} for (name, mode), vals in samples.items()]


def _picked(mlp) -> str:
    """What an auto MLP's chooser picked per linear at its training shape: "fc1=flash, fc2=stock"."""
    out = []
    for site, linear in (("fc1", mlp.linear_fc1), ("fc2", mlp.linear_fc2)):
        picks = {"stock" if p is None else "flash" for p in getattr(linear, "_flash_trained", {}).values()}
        out.append(f"{site}=" + ("/".join(sorted(picks)) or "undecided"))
    return ", ".join(out)


# ------------------------------------------------------------------ Megatron DDP rows (benchmarks/dp/run.py)

DDP_VARIANTS = ("stock", "stock, bucket per weight", "flash, every linear", "flash, first block")


def _ddp_model(tcfg, hidden: int, ffn: int, layers: int):
    """`layers` x (ColumnParallelLinear h -> f, RowParallelLinear f -> h), TP=1, no bias."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    init = torch.nn.init.xavier_normal_
    return torch.nn.Sequential(*[m for _ in range(layers) for m in (
        ColumnParallelLinear(hidden, ffn, config=tcfg, init_method=init, bias=False, gather_output=False),
        RowParallelLinear(ffn, hidden, config=tcfg, init_method=init, bias=False, input_is_parallel=True,
                          skip_bias_add=False))])


def _ddp_build(variant: str, tcfg, hidden: int, ffn: int, layers: int):
    """(module, DDP wrapper) of one variant: stock DDP (one 40M bucket, or a bucket per weight) or ours."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from megatron_flashoverlap.megatron.ddp.wrap import wrap_with_dp_overlap

    torch.manual_seed(0)
    m = _ddp_model(tcfg, hidden, ffn, layers)
    kw = {"bucket_size": hidden * ffn} if variant == "stock, bucket per weight" else {}
    dcfg = DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_grad_reduce=True, **kw)
    if variant.startswith("stock"):
        return m, DistributedDataParallel(tcfg, dcfg, m)
    chosen = list(m) if variant == "flash, every linear" else list(m)[:2]
    return m, wrap_with_dp_overlap(tcfg, dcfg, m, linears=chosen)[0]


def _ddp_step(model, ddp, x) -> None:
    """forward + backward + finish_grad_sync of one variant."""
    ddp.zero_grad_buffer()
    y = x
    for i in range(0, len(model), 2):
        y = model[i + 1](model[i](y)[0])[0]
    y.sum().backward()
    ddp.finish_grad_sync()


def measure_ddp(hidden: int, ffn: int, layers: int, tokens: int, repeats: int) -> list[dict]:
    """Rows {kind: "megatron ddp", seq: tokens, method: variant, block, spread} (block time only: the DP
    group cannot be faked inside Megatron; block = the upper median of the rank-max rounds)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    from megatron_flashoverlap.megatron import cpu

    cpu.enable()  # the optimizer's and 0.19's start_grad_sync CUDA-stream shims too
    ps.initialize_model_parallel(tensor_model_parallel_size=1)
    try:
        model_parallel_cuda_manual_seed(1)
        tcfg = TransformerConfig(num_layers=1, hidden_size=hidden, num_attention_heads=1, use_cpu_initialization=True)
        x = torch.randn(tokens, 1, hidden)
        models = {v: _ddp_build(v, tcfg, hidden, ffn, layers) for v in DDP_VARIANTS}
        samples = interleaved({v: (lambda mv=mv: timed(lambda: _ddp_step(*mv, x))) for v, mv in models.items()},
                              repeats)
    finally:
        ps.destroy_model_parallel()
    nan = float("nan")
    return [{"kind": "megatron ddp", "seq": tokens, "method": v, "mode": "fwd+bwd",
             "block": sorted(ts)[len(ts) // 2], "compute": nan, "comm": nan, "exposed": nan, "hidden": nan,
             "spread": (min(ts), max(ts)), "samples": list(ts)} for v, ts in rank_max(samples).items()]
