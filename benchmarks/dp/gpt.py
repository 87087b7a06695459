"""Rank side of benchmarks/dp/run.py's GPT rows: one training step of a Megatron GPT under DDP + DistributedOptimizer
(`overlap_grad_reduce=True`), stock vs the flash DP overlap, arms interleaved per round.

    run_ranks("benchmarks.dp.gpt:main", tp * dp, args=(cfg,))[0] -> {"config", "arms", ...}

The model: GPTModel (`layers` >= 4, hidden h, ffn 4h, untied embeddings, vocab `vocab`), fp32, one
micro-batch [b, s]; TP = cfg["tp"] (+ SP when tp > 1), DP = world / tp. Arms (ARMS; each its own model,
DDP and optimizer, identical seeds):
    stock                      stock local spec, Megatron's DDP, default bucket size (40M: one bucket here)
    stock, small buckets       the same, bucket_size = cfg["bucket"] (several buckets: only the last exposed)
    ours, fusion off           our spec (Flash TP linears), stock DDP, default buckets: the TP effect alone
    ours, auto                 our spec, wrap_with_dp_overlap's automatic choice (its calibrated cost model,
                               tokens = s x b: megatron/ddp/auto_fuse.py), default buckets; it places the rings
                               too (megatron/ddp/auto_fuse.auto_linears: at TP = 1 the DP worker thread only
                               where rings in backward would stall it; at TP > 1 the worker)
    ours, auto, small buckets  the same with bucket_size = cfg["bucket"]
    ours, auto, ring in bwd    "ours, auto" with each fused ring inside its layer's backward (asynchronous=False)
    ours, auto, worker         "ours, auto" with every fused ring on the DP worker (asynchronous=True)
Every stock reduce-scatter (Megatron's buckets, its SP mappings, the cost model's stock rate) runs as a P2P ring
at line rate unless cfg["stock_rs"] == "gloo" (benchmarks/harness/line_rate_rs.py: gloo's own moves an all-reduce's bytes).
Per arm and round, four samples (seconds, max over ranks):
    step   zero_grad_buffer, forward + loss.backward(), finalize_model_grads (finish_grad_sync + the SP
           norm all-reduce), optimizer.step() (DistributedOptimizer: its param all-gather included)
    free   the same step with the DP gradient reduction made free: backward under ddp.no_sync() (dW still
           computed and accumulated into main_grad, no reduce-scatter, fused or stock) and finalize without
           finish_grad_sync. Same model, same TP communication, same optimizer step: the difference is what
           the DP gradient reduction adds. (A DP group of 1 would change the optimizer's shards and the
           param all-gather too, so it is not used.)
    tail   from the end of loss.backward() to finalize_model_grads' return in `step`: the part of the DP
           reduction left after backward (stock's last bucket). It misses ours' synchronous ring, which
           runs inside backward: `step - free` counts both.
    bwd    loss.backward() alone in `free`: the window any overlap of the gradient reduction has (no gradient
           exists before backward, the optimizer needs them all), so no schedule exposes less than
           comm - bwd (benchmarks/dp/table.py: the link bound).
One more sample per round, "comm": ddp.start_grad_sync() + finish_grad_sync() of the stock arm alone (every
bucket's reduce-scatter, no compute), the DP communication the overlap must hide; with it "comm_cpu", the
process CPU seconds (every thread, gloo's included) it took, summed over the ranks: the host's share of moving
the bytes, which an overlap on cores that all compute cannot hide (benchmarks/dp/table.py: the host floor).
"""
from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_flashoverlap.runtime.timing import interleaved, rank_max

IN_BACKWARD_ARM = "ours, auto, ring in bwd"  # asynchronous=False: each fused ring waited in its layer's backward
WORKER_ARM = "ours, auto, worker"  # asynchronous=True: every fused ring on the DP worker thread
ARMS = ("stock", "stock, small buckets", "ours, fusion off", "ours, auto", "ours, auto, small buckets",
        IN_BACKWARD_ARM, WORKER_ARM)
PLACED = {IN_BACKWARD_ARM: False, WORKER_ARM: True}
STOCK_ARMS = ("stock", "stock, small buckets")
WARMUP = 2  # round 0: Megatron's first batch (no overlap, learns the grad-ready counts), round 1: caches


@dataclass
class Arm:
    ddp: object
    opt: object
    fused: list  # the weights whose reduce-scatter runs in their wgrad GEMM
    buckets: list  # bucket sizes in elements, in reduction order


def _config(cfg: dict):
    from megatron_flashoverlap.megatron.models import tiny_config

    h = cfg["hidden"]
    return tiny_config(cfg["tp"], cfg["tp"] > 1, num_layers=cfg["layers"], hidden=h, heads=cfg["heads"],
                       ffn=4 * h)


def _gpt(config, spec, cfg: dict):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    torch.manual_seed(7)
    model_parallel_cuda_manual_seed(7)
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=cfg["vocab"],
                    max_sequence_length=cfg["seq"], share_embeddings_and_output_weights=False)


def _build(name: str, cfg: dict) -> Arm:
    """One arm (module docstring): model from its spec, DDP (stock or ours), DistributedOptimizer."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_flashoverlap.megatron.ddp.wrap import wrap_with_dp_overlap
    from megatron_flashoverlap.megatron.spec import layer_spec

    config = _config(cfg)
    model = _gpt(config, get_gpt_layer_local_spec() if name.startswith("stock") else layer_spec(), cfg)
    kw = {"bucket_size": cfg["bucket"]} if name.endswith("small buckets") else {}
    dcfg = DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_grad_reduce=True, **kw)
    if name.startswith("ours, auto"):
        sync = {"asynchronous": PLACED[name]} if name in PLACED else {}
        ddp, fused = wrap_with_dp_overlap(config, dcfg, model, tokens=cfg["seq"] * cfg["batch"], **sync)
    else:
        ddp, fused = DistributedDataParallel(config, dcfg, model), []
    opt = get_megatron_optimizer(OptimizerConfig(use_distributed_optimizer=True, optimizer="adam", lr=1e-5,
                                                 clip_grad=0.0), [ddp])
    buckets = [bk.grad_data.numel() for buf in ddp.buffers for bk in buf.buckets]
    return Arm(ddp, opt, fused, buckets)


def _finalize(ddp, free: bool) -> None:
    """Megatron's finalize_model_grads; `free`: without finish_grad_sync (nothing was reduced)."""
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    if not free:
        return finalize_model_grads([ddp])
    ddp.finish_grad_sync = lambda *a, **k: None  # the instance attribute shadows the method for one call
    try:
        finalize_model_grads([ddp])
    finally:
        del ddp.finish_grad_sync


def _step(arm: Arm, data: dict, free: bool, tails: list, bwds: list) -> float:
    """Seconds of one training step (module docstring); appends its tail to `tails` (real steps), its
    backward to `bwds` (free steps)."""
    from megatron_flashoverlap.megatron.models import gpt_loss

    arm.ddp.zero_grad_buffer()
    arm.opt.zero_grad()
    dist.barrier()
    t0 = time.perf_counter()
    with arm.ddp.no_sync() if free else contextlib.nullcontext():
        loss = gpt_loss(arm.ddp, data)
        tb = time.perf_counter()
        loss.backward()
    t1 = time.perf_counter()
    _finalize(arm.ddp, free)
    t2 = time.perf_counter()
    arm.opt.step()
    t3 = time.perf_counter()
    if free:
        bwds.append(t1 - tb)
    else:
        tails.append(t2 - t1)
    return t3 - t0


def _comm(arm: Arm, cpus: list) -> float:
    """Seconds of every bucket's reduce-scatter alone (the gradient buffer as the last step left it); appends
    this process's CPU seconds of it to `cpus`."""
    arm.ddp.zero_grad_buffer()
    dist.barrier()
    c0, t0 = time.process_time(), time.perf_counter()
    arm.ddp.start_grad_sync()
    arm.ddp.finish_grad_sync()
    t1 = time.perf_counter()
    cpus.append(time.process_time() - c0)
    return t1 - t0


def _variants(arms: dict, data: dict, tails: dict, bwds: dict, cpus: list) -> dict:
    """{(arm, "step" | "free") or ("comm", "alone"): () -> seconds}, in round order."""
    out = {}
    for name, arm in arms.items():
        out[(name, "step")] = lambda a=arm, t=tails[name], b=bwds[name]: _step(a, data, False, t, b)
        out[(name, "free")] = lambda a=arm, t=tails[name], b=bwds[name]: _step(a, data, True, t, b)
    out[("comm", "alone")] = lambda a=arms["stock"]: _comm(a, cpus)
    return out


def check_arms(names) -> tuple:
    """The arms of a run (cfg["arms"], benchmarks/dp/run.py --arms): known, "stock" among them, and the stock arm
    with the same buckets as every "small buckets" arm of ours. -> them in ARMS order."""
    unknown = [n for n in names if n not in ARMS]
    if unknown:
        raise ValueError(f"dp arms {unknown} are not arms of benchmarks/dp/gpt.py; choose from {list(ARMS)}")
    need = {"stock"} | {"stock, small buckets" for n in names if n.endswith("small buckets")}
    if need - set(names):
        raise ValueError(f"dp arms {list(names)}: add {sorted(need - set(names))} (each arm is judged against the "
                         f"stock arm with its bucket size)")
    return tuple(n for n in ARMS if n in names)


def _names(arm: Arm, model) -> list[str]:
    ids = {id(w): n for n, w in model.named_parameters()}
    return [ids[id(w)] for w in arm.fused]


def measure(cfg: dict) -> dict:
    """{"arms": {name: {"step", "free", "tail", "bwd": [s per round], "buckets", "fused"}}, "comm", "comm_cpu":
    [s per round], "dp", "cores"}."""
    from megatron.core import parallel_state as ps

    from megatron_flashoverlap.megatron.models import batch

    names = cfg.get("arms") or ARMS
    arms = {name: _build(name, cfg) for name in names}
    data = batch(100 + ps.get_data_parallel_rank(), cfg["batch"], cfg["seq"], cfg["vocab"])  # per DP rank
    tails, bwds, cpus = {name: [] for name in names}, {name: [] for name in names}, []
    samples = interleaved(_variants(arms, data, tails, bwds, cpus), cfg["repeats"], warmup=WARMUP)
    comm_cpu = torch.tensor(cpus[WARMUP:], dtype=torch.float64)
    dist.all_reduce(comm_cpu)  # summed over the ranks: they share the cores
    samples.update({(name, "tail"): tails[name][WARMUP:] for name in names})
    samples.update({(name, "bwd"): bwds[name][WARMUP:] for name in names})
    samples = rank_max(samples)
    out = {name: {"step": samples[(name, "step")], "free": samples[(name, "free")],
                  "tail": samples[(name, "tail")], "bwd": samples[(name, "bwd")], "buckets": arms[name].buckets,
                  "fused": _names(arms[name], arms[name].ddp.module)} for name in names}
    return {"arms": out, "comm": samples[("comm", "alone")], "comm_cpu": comm_cpu.tolist(),
            "dp": ps.get_data_parallel_world_size(), "cores": len(os.sched_getaffinity(0))}


def main(rank: int, world: int, cfg: dict) -> dict | None:
    """The rank entry: TP groups of cfg["tp"], every arm measured; rank 0 returns the samples + the log."""
    import logging

    from megatron_flashoverlap.megatron.ddp import wrap as ddp_linear
    from megatron_flashoverlap.megatron.models import destroy, init_tp

    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    ddp_linear.log.addHandler(handler)
    ddp_linear.log.setLevel("INFO")
    init_tp(cfg["tp"])
    mode = cfg.get("stock_rs", "ring")
    from benchmarks.harness.line_rate_rs import CALLS, stock_reduce_scatter
    try:
        with stock_reduce_scatter(mode):
            res = measure(cfg)
        if mode == "ring":
            res["line_rate_calls"] = dict(CALLS)
    finally:
        destroy()
        ddp_linear.log.removeHandler(handler)
    return {"config": cfg, "world": world, **res, "log": lines} if rank == 0 else None
