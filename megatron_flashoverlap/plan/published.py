"""Validation against published GPU measurements (validation/published.csv): one command, one results file.

    python -m megatron_flashoverlap.plan validate --out results.csv [--table published.csv]

Per row (kinds): op (one AG+GEMM / GEMM+RS, forward: ops.py), collective (a stock NCCL collective), gemm_collective
(a GEMM and an independent collective, one after the other), e2e (a training step: train_step.py; tokens/s per GPU),
reconstructed (a published range on a reconstructed layout: the decode all-reduce), unscored (hardware unknown:
listed, never scored). A collective row's `level` says what was timed: `kernel` (NCCL's kernel alone, device time:
priced without the torch call's own cost, links.Net.kernel) or a whole torch.distributed call (the default). The
model is never fitted to these rows: every number comes from catalog.py.

Targets, reported met or missed:
    baseline   predicted stock time within BASELINE_TOL (15 %) of the published one, on >= BASELINE_SHARE (90 %) of
               the scored rows
    gain       where the published overlap has our structure (`structure` = ours) and paid: the predicted gain of
               flash (every site flash for e2e rows) within GAIN_TOL (5) points of the published gain
    no gain    where the published overlap of our structure did not pay: the predicted gain below GAIN_TOL too
gain = baseline time / overlapped time - 1 (for tokens/s: overlapped / baseline - 1), in percent.
"""
from __future__ import annotations

import argparse
import csv
import shlex
from pathlib import Path

from . import catalog
from .flags import main_parser, model_of, sizes
from .collectives import all_reduce
from .hardware import Cluster
from .links import Group
from .ops import column_fwd, row_fwd
from .price import Env
from .train_step import plan_step

TABLE = Path(__file__).with_name("validation") / "published.csv"
BASELINE_TOL, BASELINE_SHARE, GAIN_TOL = 0.15, 0.90, 5.0
SCALE = {"ms": 1e3, "us": 1e6}


def _env(row: dict) -> tuple[Env, Group]:
    gpn, nodes, tp = int(row["gpus_per_node"]), int(row["nodes"]), int(row["tp"])
    cluster = Cluster(catalog.GPUS[row["gpu"]], catalog.LINKS[row["intra"]], catalog.LINKS[row["inter"]], gpn, nodes)
    per = min(tp, gpn)
    return Env(cluster, row["dtype"] or "bf16"), Group(tp, per, max(1, gpn // per))


def _op(row: dict) -> tuple[float, float | None]:
    env, g = _env(row)
    m, k, n = int(row["m"]), int(row["k"]), int(row["n"])
    t = (column_fwd if row["op"] == "all_gather_matmul" else row_fwd)(env, g, m, k, n)
    return t.time("reference"), t.time("flash")


def _collective(row: dict) -> tuple[float, float | None]:
    env, g = _env(row)
    price = env.net.kernel if row.get("level") == "kernel" else env.net.collective
    coll = price(row["op"], float(row["bytes"]), g)
    if row["kind"] == "gemm_collective":
        coll += env.mm(int(row["m"]), int(row["k"]), int(row["n"]))
    return coll, None


def _e2e(row: dict) -> tuple[float, float]:
    a = main_parser().parse_args(shlex.split(row["args"]) + ["--gpu", row["gpu"], "--nodes", row["nodes"],
                                                             "--inter-node", row["inter"]])
    layout, nodes = sizes(a)
    env, _ = _env(row)
    model = model_of(a)
    tokens = model.global_batch * model.seq / env.cluster.world
    stock = plan_step(env, model, layout).step(True)
    flash = plan_step(env, model, layout, force="flash").step(False)
    return tokens / stock, tokens / flash


def _nvrar(row: dict) -> tuple[float, float]:
    env, _ = _env(row)
    per = int(row["gpus_per_node"])
    t = all_reduce(env, Group(int(row["tp"]), per, 1), float(row["bytes"]))
    return t.time("reference") / t.time("flash"), t.time("reference") / t.times["flash:hierarchical"]


def _gain(base: float, over: float, unit: str) -> float:
    return (over / base - 1) * 100 if unit == "tokens_per_s_per_gpu" else (base / over - 1) * 100


def predict(row: dict) -> dict:
    """The prediction and the verdicts of one row (module docstring)."""
    kind, unit = row["kind"], row["unit"]
    out = {"id": row["id"], "kind": kind, "expect": row["expect"], "unit": unit, "published": row["baseline"],
           "published_overlapped": row["overlapped"]}
    if kind == "unscored":
        return {**out, "verdict": "not scored: hardware not stated"}
    if kind == "reconstructed":
        best, hier = _nvrar(row)
        lo, hi = float(row["baseline"]), float(row["overlapped"])
        return {**out, "predicted": f"{best:.2f}", "predicted_hierarchical": f"{hier:.2f}",
                "verdict": "within range" if lo <= best <= hi else f"MISS: published speedup {lo}-{hi}x"}
    base, over = (_op if kind == "op" else _e2e if kind == "e2e" else _collective)(row)
    scale = SCALE.get(unit, 1.0)
    pred = base * scale
    err = pred / float(row["baseline"]) - 1
    out.update(predicted=f"{pred:.4g}", error_pct=f"{err * 100:+.1f}", baseline_ok=abs(err) <= BASELINE_TOL)
    if over is not None and row["structure"] == "ours" and row["overlapped"]:
        pub = _gain(float(row["baseline"]), float(row["overlapped"]), unit)
        mine = _gain(base * scale, over * scale, unit)
        ok = abs(mine - pub) <= GAIN_TOL if row["expect"] == "gain" else mine < GAIN_TOL
        out.update(gain_published=f"{pub:+.1f}", gain_predicted=f"{mine:+.1f}",
                   gain_ok=ok, target="gain within 5 points" if row["expect"] == "gain" else "no gain predicted")
    return out


def summary(results: list[dict]) -> list[str]:
    base = [r for r in results if "baseline_ok" in r]
    gains = [r for r in results if r.get("target") == "gain within 5 points"]
    none = [r for r in results if r.get("target") == "no gain predicted"]
    n_ok = sum(r["baseline_ok"] for r in base)
    met = n_ok >= BASELINE_SHARE * len(base)
    lines = [f"baseline within 15 %: {n_ok} of {len(base)} rows ({n_ok / len(base) * 100:.1f} %, target >= 90 %): "
             f"{'MET' if met else 'MISSED'}",
             f"gain within 5 points: {sum(r['gain_ok'] for r in gains)} of {len(gains)} rows"
             f"{' (all)' if gains and all(r['gain_ok'] for r in gains) else ''}",
             f"no-gain cases predicted as no gain: {sum(r['gain_ok'] for r in none)} of {len(none)} rows"]
    misses = [r["id"] for r in results if r.get("baseline_ok") is False or r.get("gain_ok") is False
              or str(r.get("verdict", "")).startswith("MISS")]
    return lines + [f"misses: {', '.join(misses) if misses else 'none'}"]


FIELDS = ("id", "kind", "expect", "unit", "published", "predicted", "error_pct", "baseline_ok",
          "published_overlapped", "gain_published", "gain_predicted", "gain_ok", "target",
          "predicted_hierarchical", "verdict")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="flashoverlap-plan validate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--table", default=str(TABLE))
    ap.add_argument("--out", default=None, help="results CSV (default: print only)")
    a = ap.parse_args(argv)
    with open(a.table, newline="") as f:
        results = [predict(row) for row in csv.DictReader(f)]
    if a.out:
        with open(a.out, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
            w.writeheader()
            w.writerows(results)
    for r in results:
        print(", ".join(f"{k}={r[k]}" for k in FIELDS if k in r))
    print("\n".join(["", "PREDICTIONS of the model against published measurements:"] + summary(results)))
    return 0
