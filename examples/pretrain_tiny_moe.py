"""A tiny MoE GPT on Megatron's own training loop: stock vs ours for every MoE exchange algorithm, EP=2.

Runs the project entry on Megatron's mock GPT data (same seed, same data, same initial weights), 2 CPU
ranks = EP 2 x DP 2 (TP 1), 4 experts, top-2, the alltoall dispatcher, an aux loss:

    python -m megatron_flashoverlap.pretrain_gpt --cpu --nproc-per-node 2 <tiny MoE args>              stock
    python -m megatron_flashoverlap.pretrain_gpt --cpu --nproc-per-node 2 <tiny MoE args> --flash-overlap
        --flash-overlap-config <yaml: "moe: {algo: A}">                  ours, once per A in config.MOE_ALGOS

and prints Megatron's `lm loss` of every run side by side, the max |diff| against stock per algorithm, the
sites line (ep_a2a=A proves our dispatcher ran) and each run's wall time. Under a minute per run on 2 cores.

    python examples/pretrain_tiny_moe.py [--iters 10] [--algos flash,exchange,reference] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from examples.pretrain_tiny_gpt import run_entry  # noqa: E402
from megatron_flashoverlap.config import MOE_ALGOS  # noqa: E402

TINY_MOE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
            "--max-position-embeddings", "64", "--micro-batch-size", "4", "--global-batch-size", "8",
            "--lr", "1e-3", "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "1000000",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "128", "--mock-data", "--seed", "1234",
            "--num-experts", "4", "--moe-router-topk", "2", "--expert-model-parallel-size", "2",
            "--moe-token-dispatcher-type", "alltoall", "--moe-aux-loss-coeff", "1e-2"]


def moe_args(iters: int) -> list[str]:
    return [*TINY_MOE, "--train-iters", str(iters)]


def train_all(iters: int, timeout: float, algos=MOE_ALGOS) -> dict:
    """{"stock": run, algo: run for every word of `algos`}; run = {"loss", "sites", "seconds"}."""
    runs = {"stock": run_entry(moe_args(iters), "stock", timeout)}
    with tempfile.TemporaryDirectory(prefix="tiny-moe-") as tmp:
        for algo in algos:
            yaml = os.path.join(tmp, f"moe_{algo}.yaml")
            with open(yaml, "w") as f:
                f.write(f"moe: {{algo: {algo}}}\n")
            flags = ["--flash-overlap", "--flash-overlap-config", yaml]
            runs[algo] = run_entry([*moe_args(iters), *flags], algo, timeout)
    return runs


def max_diffs(runs: dict) -> dict:
    """{algo: max over iterations of |lm loss stock - lm loss algo|}."""
    stock = runs["stock"]["loss"]
    return {a: max(abs(x - y) for x, y in zip(stock, r["loss"])) for a, r in runs.items() if a != "stock"}


def report(runs: dict) -> str:
    """The side-by-side table, then per algorithm its sites line and max |diff|, then wall times."""
    arms = list(runs)
    rows = ["iter  " + "  ".join(f"{'lm loss ' + a:>17}" for a in arms)]
    for i, vals in enumerate(zip(*(runs[a]["loss"] for a in arms))):
        rows.append(f"{i + 1:4d}  " + "  ".join(f"{v:17.6f}" for v in vals))
    rows.append("")
    for algo, d in max_diffs(runs).items():
        rows.append(f"moe.algo={algo}: {runs[algo]['sites']}; max |lm loss stock - lm loss {algo}| over "
                    f"{len(runs['stock']['loss'])} iterations: {d:.2e}")
    rows.append("wall time per run: " + ", ".join(f"{a} {runs[a]['seconds']:.0f} s" for a in arms)
                + " (2 ranks on a shared CPU over loopback gloo, start-up included: not a speed claim)")
    return "\n".join(rows)


def _algos(text: str) -> tuple:
    words = tuple(w for w in text.split(",") if w)
    bad = [w for w in words if w not in MOE_ALGOS]
    if bad or not words:
        raise argparse.ArgumentTypeError(f"--algos {text!r}: give one or more of {','.join(MOE_ALGOS)}, "
                                         f"comma-separated")
    return words


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--algos", type=_algos, default=MOE_ALGOS,
                   help=f"comma-separated moe.algo words to run against stock (default: all, {','.join(MOE_ALGOS)})")
    p.add_argument("--json", default=None, help="also write every curve as JSON here")
    p.add_argument("--timeout", type=float, default=300, help="seconds per run before it is killed")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse(argv)
    print(f"Megatron's pretrain() on mock data, tiny MoE GPT (2 layers, hidden 64, 4 experts, top-2, alltoall "
          f"dispatcher), EP=2 on 2 CPU ranks (gloo), {args.iters} iterations: stock, then ours with moe.algo in "
          f"{args.algos}", flush=True)
    runs = train_all(args.iters, args.timeout, args.algos)
    print(report(runs))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**runs, "max_diff": max_diffs(runs)}, f)
    return runs


if __name__ == "__main__":
    main()
