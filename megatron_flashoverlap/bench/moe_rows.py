"""Rank side of benchmarks/moe.py: one Megatron MoE layer (alltoall dispatcher), stock against ours.

    run_ranks("megatron_flashoverlap.bench.moe_rows:main", P, args=(cfg,))[0] -> {"config", "world", "rows"}
    cfg: {"tokens", "hidden", "ffn", "experts", "topk", "repeats"}        EP = P (TP = 1), top-k routing

Methods: "stock" (Megatron's MoEAlltoAllTokenDispatcher: all_to_all_single), "flash" (ours: the pairwise
exchange of ops/moe on the one executor). Modes fwd and fwd+bwd; one interleaved loop (bench/rounds.py)
over method x mode, one warm-up round; a figure = the median over rounds of the max over ranks.
The same seed builds the same weights for both; tokens differ per rank (uneven split sizes).
"""
from __future__ import annotations

import statistics

import torch

from .rounds import interleaved, rank_max, timed

METHODS = ("stock", "flash")
MODES = ("fwd", "fwd+bwd")


def _layer(cfg: dict, world: int, method: str):
    """The MoE layer (decoder.layers[0].mlp) of a 1-layer MoE GPT built from stock's or our spec."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from ..config import from_dict
    from ..megatron import models as tm
    from ..megatron.spec import get_gpt_layer_flashoverlap_spec

    config = tm.tiny_config(1, False, num_layers=1, hidden=cfg["hidden"], heads=4, ffn=cfg["ffn"],
                            num_moe_experts=cfg["experts"], moe_router_topk=cfg["topk"],
                            moe_token_dispatcher_type="alltoall", expert_model_parallel_size=world,
                            moe_ffn_hidden_size=cfg["ffn"], add_bias_linear=False, moe_aux_loss_coeff=0.0)
    if method == "stock":
        spec = get_gpt_layer_local_spec(num_experts=cfg["experts"])
    else:
        flash = from_dict({"moe": {"algo": method}})
        spec = get_gpt_layer_flashoverlap_spec(num_experts=cfg["experts"], flash_config=flash)
    return tm.build_gpt(config, spec).decoder.layers[0].mlp


def _call(layer, x: torch.Tensor, mode: str) -> float:
    def run():
        y = layer(x)[0]
        if mode != "fwd":
            y.sum().backward()
    return timed(run)


def main(rank: int, world: int, cfg: dict) -> dict | None:
    """The rank entry for `run_ranks`: rows per method and mode; rank 0 returns {"config", "world", "rows"}."""
    from megatron.core import parallel_state

    from ..megatron import cpu

    torch.set_num_threads(1)
    cpu.enable()
    parallel_state.initialize_model_parallel(expert_model_parallel_size=world)
    try:
        x = torch.randn(cfg["tokens"], 1, cfg["hidden"], generator=torch.Generator().manual_seed(rank),
                        requires_grad=True)
        layers = {m: _layer(cfg, world, m) for m in METHODS}
        variants = {(m, mode): (lambda m=m, mode=mode: _call(layers[m], x, mode)) for m in METHODS for mode in MODES}
        med = {k: statistics.median(v) for k, v in rank_max(interleaved(variants, cfg["repeats"])).items()}
    finally:
        parallel_state.destroy_model_parallel()
    rows = [{"method": m, "mode": mode, "block": med[(m, mode)]} for m in METHODS for mode in MODES]
    return {"config": cfg, "world": world, "rows": rows} if rank == 0 else None


def table(res: dict) -> str:
    out = ["| method | mode | layer ms | vs stock |", "|---|---|---|---|"]
    stock = {r["mode"]: r["block"] for r in res["rows"] if r["method"] == "stock"}
    for r in res["rows"]:
        out.append(f"| {r['method']} | {r['mode']} | {r['block'] * 1e3:.1f} | {r['block'] / stock[r['mode']]:.2f} |")
    return "\n".join(out)
