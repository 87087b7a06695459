"""Rank side of benchmarks/moe/run.py: one Megatron MoE layer (alltoall dispatcher), stock against ours.

    run_ranks("benchmarks.moe.rows:main", P, args=(cfg,))[0] -> {"config", "world", "rows"}
    cfg: {"tokens", "hidden", "ffn", "experts", "topk", "repeats"}   EP = P, TP = expert-TP = 1, SequentialMLP

Methods (rows): "stock" = Megatron's unmodified MoELayer (MoEAlltoAllTokenDispatcher: all_to_all_single),
then ours (FlashMoELayer) once per word of config.MOE_SITE_ALGOS (auto included), whatever that tuple holds. Modes
fwd and fwd+bwd. Per (method, mode) three measured calls, every one a variant of one interleaved loop
(runtime/timing.py; one warm-up round; a sample = the max over ranks of one call after a barrier):

    block    the layer on the real (shaped) EP group
    compute  the SAME layer object, its dispatcher's `ep_group` swapped for torch's fake process group of the
             same size for the call (forward and the backward it records): the token and prob exchanges
             complete at once without moving data, while routing, the split-size count (an all-gather on
             `tp_ep_group`, which stays real), permutation, the expert GEMMs over the same token counts and
             unpermute run exactly as in `block`. The received rows are then uninitialised memory (denormals
             flushed): the GEMM cost does not depend on the values.
    comm     the same layer built with expert ffn width 1 and the full layer's router weight copied in: the
             same routes, split sizes, transfers and executor walk, expert GEMMs shrunk to O(bytes). It still
             pays routing + permutation (O(tokens x h) memory work), so it over-states the exchange a little
             and the hidden fraction errs high by that much (the table says so).
The rows then go through benchmarks/harness/estimator.py (timing.combine / timing.derived): hidden, distance to the bound
max(compute, comm), their 90 % intervals, and each row's per-round block samples for speedup intervals.
Weights: one seed for every layer (stock and ours start equal); tokens differ per rank (uneven splits).
"""
from __future__ import annotations

import torch

from megatron_flashoverlap.config import MOE_SITE_ALGOS
from benchmarks.harness import timing
from benchmarks.harness.moe_layer import call as _call, layer as _layer
from megatron_flashoverlap.runtime.timing import interleaved, rank_max

MODES = ("fwd", "fwd+bwd")


def methods() -> tuple[str, ...]:
    """The rows: Megatron stock first, then ours for every moe.algo the config knows (auto: the default, stock or
    flash as its first training forward measures them; the measurement falls in the warm-up round)."""
    return ("stock", *MOE_SITE_ALGOS)


def _pair(cfg: dict, world: int, method: str) -> tuple:
    """(full layer, comm-only layer with expert ffn 1 and the full layer's router weight); one config, so under
    auto the thin layer runs what the full layer's measurement picked (the same key)."""
    from megatron_flashoverlap.config import from_dict

    shared = from_dict({"moe": {"algo": method}}) if method != "stock" else None
    full, thin = _layer(cfg, world, method, cfg["ffn"], shared), _layer(cfg, world, method, 1, shared)
    with torch.no_grad():
        thin.router.weight.copy_(full.router.weight)
    return full, thin


def variants(pairs: dict, x: torch.Tensor, fake) -> dict:
    """{(method, mode, measure): () -> seconds} for every method in `pairs` ({method: (full, thin)})."""
    out = {}
    for m, (full, thin) in pairs.items():
        for mode in MODES:
            out[(m, mode, "block")] = lambda f=full, mode=mode: _call(f, x, mode)
            out[(m, mode, "compute")] = lambda f=full, mode=mode: _call(f, x, mode, fake)
            out[(m, mode, "comm")] = lambda t=thin, mode=mode: _call(t, x, mode)
    return out


def main(rank: int, world: int, cfg: dict) -> dict | None:
    """The rank entry for `run_ranks`: one row per method and mode; rank 0 returns {"config", "world", "rows"}."""
    from megatron.core import parallel_state

    from megatron_flashoverlap.megatron import cpu

    torch.set_num_threads(1)
    torch.set_flush_denormal(True)  # the fake group leaves received rows uninitialised: no denormal slow-down
    cpu.enable()
    parallel_state.initialize_model_parallel(expert_model_parallel_size=world)
    try:
        fake = timing.fake_group(world)
        x = torch.randn(cfg["tokens"], 1, cfg["hidden"], generator=torch.Generator().manual_seed(rank))
        pairs = {m: _pair(cfg, world, m) for m in methods()}
        stats = timing.combine(rank_max(interleaved(variants(pairs, x, fake), cfg["repeats"])))
    finally:
        parallel_state.destroy_model_parallel()
    rows = [{"method": m, "mode": mode, **timing.derived(stats, m, mode)} for m in methods() for mode in MODES]
    picked = {m: "flash" if full.flash_fused else "stock" for m, (full, _) in pairs.items() if m == "auto"}
    return {"config": cfg, "world": world, "rows": rows, "picked": picked} if rank == 0 else None
