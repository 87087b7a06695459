"""flashoverlap-plan (also python -m megatron_flashoverlap.plan): which overlap each site should run, predicted.

    flashoverlap-plan --hidden-size 8192 --num-attention-heads 64 --seq-length 8192 --num-layers 80
        --tensor-model-parallel-size 8 --sequence-parallel --gpu h100 --nodes 32 [--json]
        [--emit-config plan.yaml] [--timeline layer.png]
    flashoverlap-plan op --op all_gather_matmul|matmul_reduce_scatter|all_reduce --m M --k K --n N --tp P
        --gpu NAME [--nodes N] [--dtype bf16] [--bytes B] --json
    flashoverlap-plan validate [--out results.csv]       the published GPU measurements (published.py)
    flashoverlap-plan where                              where the flag pays on GPU clusters (where.py)

The op form: M, K, N are the unsharded GEMM y[M, N] = x[M, K] W[K, N] (all-gather + GEMM: x's rows and W's
columns over P; GEMM + reduce-scatter: K over P, the output's rows scattered), forward; --json prints
{"reference_ms", "slicing_ms", "flash_ms", "bound_ms"}: reference = blocking collective then GEMM (all_reduce:
NCCL's choice), slicing = its best chunk count (all_reduce: nothing to slice under, so the reference), flash =
our best ring variant (all_reduce: our best schedule), bound = ops.py / collectives.all_reduce.
"""
from __future__ import annotations

import argparse
import json
import sys

from . import flags as A
from .links import Group
from .price import Env


def run_main(argv) -> int:
    from . import emit, report, timeline
    from .train_step import plan_step
    a = A.main_parser(__doc__).parse_args(argv)
    layout, nodes = A.sizes(a)
    env = Env(A.cluster_of(a, nodes), a.dtype or "bf16")
    st = plan_step(env, A.model_of(a), layout, a.decode_batch)
    inputs = {k: v for k, v in vars(a).items() if k not in ("json", "emit_config", "timeline")}
    print(json.dumps(report.to_json(st, inputs), indent=1) if a.json else report.text(st, env, inputs))
    if a.emit_config:
        emit.write(st, a.emit_config, f"flashoverlap-plan for {a.gpu} x {env.cluster.world} (prediction)")
        print(f"wrote {a.emit_config}", file=sys.stderr)
    if a.timeline:
        timeline.draw(st, a.timeline)
        print(f"wrote {a.timeline}", file=sys.stderr)
    return 0


def op_times(a: argparse.Namespace) -> dict:
    """{"reference_ms", "slicing_ms", "flash_ms", "bound_ms"} of the op form (module docstring)."""
    from . import collectives, ops
    nodes = a.nodes or 1
    if a.tp < 1 or a.tp % nodes or (a.tp // nodes) > a.gpus_per_node:
        raise ValueError(f"--tp {a.tp} over --nodes {nodes}: the TP ranks per node (tp / nodes) must be a whole "
                         f"number <= --gpus-per-node {a.gpus_per_node}")
    env = Env(A.cluster_of(a, nodes), a.dtype)
    per = a.tp // nodes
    g = Group(a.tp, per, max(1, a.gpus_per_node // per))
    if a.op == "all_reduce":
        if a.bytes is None or a.bytes < 1:
            raise ValueError("--op all_reduce needs --bytes B >= 1 (the message per rank)")
        t = collectives.all_reduce(env, g, a.bytes)
        ref = t.time("reference")
        return _ms4(ref, ref, t.time("flash") if a.tp > 1 else ref, t.bound)
    missing = [f for f in ("m", "k", "n") if getattr(a, f) is None or getattr(a, f) < 1]
    if missing:
        raise ValueError(f"--op {a.op} needs --m, --k, --n >= 1 (missing: {missing})")
    fn = ops.column_fwd if a.op == "all_gather_matmul" else ops.row_fwd
    t = fn(env, g, a.m, a.k, a.n)
    if a.tp == 1:
        return _ms4(t.compute, t.compute, t.compute, t.compute)
    best_flash = min(t.time("flash"), t.time("flash_bidir"))
    return _ms4(t.time("reference"), t.time("slicing"), best_flash, t.bound)


def _ms4(ref: float, sl: float, fl: float, bound: float) -> dict:
    return {"reference_ms": ref * 1e3, "slicing_ms": sl * 1e3, "flash_ms": fl * 1e3, "bound_ms": bound * 1e3}


def run_op(argv) -> int:
    a = A.op_parser().parse_args(argv)
    out = op_times(a)
    if a.json:
        print(json.dumps(out))
    else:
        print(f"flashoverlap-plan op {a.op} (PREDICTION): " + ", ".join(f"{k} {v:.4f}" for k, v in out.items()))
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv[:1] == ["op"]:
            return run_op(argv[1:])
        if argv[:1] == ["validate"]:
            from .published import main as validate_main
            return validate_main(argv[1:])
        if argv[:1] == ["where"]:
            from .where import main as where_main
            return where_main(argv[1:])
        return run_main(argv)
    except ValueError as err:
        print(f"flashoverlap-plan: error: {err}", file=sys.stderr)
        return 2
