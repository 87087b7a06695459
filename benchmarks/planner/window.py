"""Rank side of the planner's one-window run (run.py --one-window): the chooser's start-up probe and the measured
points, one after another in one process group, so every point has a calibration taken just before it and one
just after.

    run_ranks("benchmarks.planner.window:main", P, args=(cfg,), ns=...)[0] -> {"calibrations", "points"}
    cfg: {"gpus_per_node", "rounds", "passes", "points": [settings.WINDOW_* dicts],
          "probe": {"shapes", "sizes", "dtype", "gelu", "add", "slowdown"}}
    order: calibration 0, then `passes` times over the points: the point, a calibration. Point i (in run order)
           sits between calibrations i and i + 1.

A calibration:
    probe      megatron/probe.py `measure`, the chooser's start-up probe itself: the GEMMs of `shapes`, an exchange
               with the node's neighbour and one across nodes at each of `sizes`, stock's all-gather and
               all-reduce at `sizes` (median of `rounds` after a warm-up, max over ranks)
    add, gelu  the elementwise work the proxy prices (calibrate.py's variants through the same timing loop:
               runtime/timing.py, the max over ranks): an add of `add` elements in `dtype`, F.gelu forward and
               backward per (rows, width)
    slowdown   a GEMM alone and beside a stock all-gather of `slowdown`[1] bytes (calibrate.py)
A point: its settings and "samples" {method: {mode: [seconds per kept round, max over ranks]}}, every method and
mode one variant of one interleaved loop (rotated per round, one warm-up round). Modes: fwd and fwd+bwd for the
blocks and the MoE layer; the message size in bytes for the all-reduce.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_flashoverlap.megatron.probe import measure
from megatron_flashoverlap.runtime import OverlapContext
from megatron_flashoverlap.runtime.timing import interleaved, pass_seconds, rank_max, timed
from benchmarks.harness.blocks import Method, Shape, make_block, method_by_name
from benchmarks.planner import calibrate as C
from benchmarks.planner import settings as S

MODES = ("fwd", "fwd+bwd")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def calibration(cfg: dict, world: int) -> dict:
    """One calibration (module docstring)."""
    pr = cfg["probe"]
    out = {"probe": measure([tuple(s) for s in pr["shapes"]], cfg["gpus_per_node"], hop_bytes=tuple(pr["sizes"]),
                            stock_bytes=tuple(pr["sizes"]), rounds=cfg["rounds"])}
    dtype = DTYPES[pr["dtype"]]
    with torch.no_grad():
        out["add"] = C.figures_of(C.add_variants(pr["add"], dtype), cfg["rounds"])
        if pr.get("slowdown"):
            out["slowdown"] = C.figures_of(C.slowdown_variants(tuple(pr["slowdown"][0]), pr["slowdown"][1], world),
                                         cfg["rounds"])
    if pr.get("gelu"):
        out["gelu"] = C.figures_of(C.gelu_variants([tuple(s) for s in pr["gelu"]]), cfg["rounds"])
    return out


def _method(kind: str, name: str) -> Method:
    if kind == "mlp_nosp":
        algo, chunks = S.NOSP_METHODS[name]
        return Method(name, algo, chunks)
    return method_by_name(name)


def block_variants(pt: dict, world: int) -> dict:
    """{(method, mode): () -> seconds} of one block (harness/blocks.py) per method and mode."""
    block = make_block(pt["kind"], Shape(pt["seq"], 1, pt["hidden"], pt["width"]), world)
    x = block.input()
    dy = torch.randn_like(x)  # y has x's shape: [s/P, b, h] with SP, [s, b, h] without
    ctx = OverlapContext(check_peers=False)
    out = {}
    for name in pt["methods"]:
        m = _method(pt["kind"], name)
        for mode in MODES:
            out[(name, mode)] = (lambda m=m, mode=mode: pass_seconds(
                lambda t: block.forward(t, None, m, ctx), x, mode, dy, block.params()))
    return out


def moe_variants(pt: dict, world: int) -> dict:
    """{(method, mode): () -> seconds} of one MoE layer (harness/moe_layer.py), stock and ours."""
    from megatron.core import parallel_state

    from benchmarks.harness import moe_layer
    from megatron_flashoverlap.megatron import cpu

    cpu.enable()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(expert_model_parallel_size=world)
    x = torch.randn(pt["tokens"], 1, pt["hidden"], generator=torch.Generator().manual_seed(dist.get_rank()))
    layers = {m: moe_layer.layer(pt, world, m, pt["ffn"]) for m in pt["methods"]}
    return {(m, mode): (lambda lay=lay, mode=mode: moe_layer.call(lay, x, mode))
            for m, lay in layers.items() for mode in MODES}


def all_reduce_variants(pt: dict, world: int) -> dict:
    """{(method, bytes): () -> seconds} of one all-reduce per method and message size (the topology table's
    call: ops/all_reduce, bf16, the node layout given)."""
    from megatron_flashoverlap.ops.all_reduce.all_reduce import all_reduce

    dtype, ctx, out = DTYPES[pt["dtype"]], OverlapContext(check_peers=False), {}
    for nbytes in pt["sizes"]:
        x = torch.randn(nbytes // torch.empty((), dtype=dtype).element_size()).to(dtype)
        for m in pt["methods"]:
            algo = "reference" if m == "stock" else m
            out[(m, str(nbytes))] = (lambda x=x, algo=algo: timed(
                lambda: all_reduce(x, None, algo=algo, local_world_size=pt["local"], context=ctx)))
    return out


VARIANTS = {"mlp": block_variants, "mlp_nosp": block_variants, "moe": moe_variants, "all_reduce": all_reduce_variants}


def by_method(samples: dict) -> dict:
    """{(method, mode): [seconds]} -> {method: {mode: [seconds]}}: a point's "samples"."""
    out: dict = {}
    for (m, mode), s in samples.items():
        out.setdefault(m, {})[mode] = s
    return out


def point(pt: dict, rounds: int, world: int) -> dict:
    """The point's settings and samples (module docstring)."""
    return {**pt, "samples": by_method(rank_max(interleaved(VARIANTS[pt["kind"]](pt, world), rounds, rotate=True)))}


def main(rank: int, world: int, cfg: dict) -> dict | None:
    """The rank entry for `run_ranks`: calibrations and points in run order (module docstring)."""
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    from benchmarks.harness.line_rate_rs import stock_reduce_scatter

    cals, points = [], []
    with stock_reduce_scatter("ring"):  # stock's reduce-scatters at line rate, as the tables measured them
        cals.append(calibration(cfg, world))
        for _ in range(cfg["passes"]):
            for pt in cfg["points"]:
                points.append(point(pt, cfg["rounds"], world))
                cals.append(calibration(cfg, world))
    return {"calibrations": cals, "points": points} if rank == 0 else None
