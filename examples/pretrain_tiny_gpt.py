"""The README's main job: Megatron's own training loop, stock vs `--flash-overlap`, TP=2 + SP on 2 CPU ranks.

Runs the project entry twice on Megatron's mock GPT data (same seed, same data, same initial weights):

    python -m megatron_flashoverlap.pretrain_gpt --cpu --nproc-per-node 2 <tiny GPT args>                  stock
    python -m megatron_flashoverlap.pretrain_gpt --cpu --nproc-per-node 2 <tiny GPT args> --flash-overlap \
        --flash-overlap-config configs/flash.yaml                                                          ours

configs/flash.yaml runs our operators at every GEMM site (the flag alone runs `auto`: each site measured at
the first training step, stock kept where ours does not win, which on this tiny model is most of them), then
prints Megatron's `lm loss` of both side by side, the line naming what each GEMM site ran, and writes
a plot. About a minute on 2 cores.

    python examples/pretrain_tiny_gpt.py [--iters 30] [--model gpt2|llama] [--plot PATH] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
        "--max-position-embeddings", "64", "--micro-batch-size", "4", "--global-batch-size", "4",
        "--tensor-model-parallel-size", "2", "--sequence-parallel", "--lr", "1e-3", "--log-interval", "1",
        "--eval-iters", "0", "--eval-interval", "1000000", "--tokenizer-type", "NullTokenizer",
        "--vocab-size", "128", "--mock-data", "--seed", "1234"]
STYLES = {"gpt2": [],  # LayerNorm, GELU, learned positions, tied embeddings, biases: Megatron's defaults
          "llama": ["--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope",
                    "--untie-embeddings-and-output-weights", "--disable-bias-linear"]}
FLASH = ["--flash-overlap", "--flash-overlap-config", os.path.join(ROOT, "configs", "flash.yaml")]
LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.eE+-]+)")


def megatron_args(iters: int, model: str) -> list[str]:
    return [*TINY, "--train-iters", str(iters), *STYLES[model]]


def train(arm: str, iters: int, model: str, timeout: float) -> dict:
    """One run of the entry on 2 CPU ranks; -> {"loss": [per iteration], "sites": line, "seconds"}."""
    return run_entry([*megatron_args(iters, model), *(FLASH if arm == "flash" else [])], arm, timeout)


def run_entry(args: list[str], arm: str, timeout: float, nproc: int = 2) -> dict:
    """The project entry on `nproc` CPU ranks with Megatron `args`; -> {"loss", "sites", "seconds"}."""
    cmd = [sys.executable, "-m", "megatron_flashoverlap.pretrain_gpt", "--cpu", "--nproc-per-node", str(nproc), *args]
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{arm} run failed (exit {proc.returncode}): {' '.join(cmd)}\n{proc.stdout[-2000:]}"
                           f"\n{proc.stderr[-4000:]}")
    steps = {int(i): float(v) for i, v in LOSS.findall(proc.stdout)}
    sites = [ln for ln in proc.stdout.splitlines() if ln.startswith("GEMM sites: ")]
    return {"loss": [steps[i] for i in sorted(steps)], "sites": sites[-1] if sites else "GEMM sites: ?",
            "seconds": time.perf_counter() - t0}


def report(runs: dict) -> str:
    """The side-by-side table and the summary lines."""
    stock, flash = runs["stock"]["loss"], runs["flash"]["loss"]
    rows = [f"{'iter':>4}  {'lm loss stock':>13}  {'lm loss flash':>13}  {'|diff|':>8}"]
    rows += [f"{i + 1:4d}  {a:13.6f}  {b:13.6f}  {abs(a - b):8.1e}" for i, (a, b) in enumerate(zip(stock, flash))]
    rows += ["", f"--flash-overlap {runs['flash']['sites']}",
             f"max |lm loss stock - lm loss flash| over {len(stock)} iterations: {max_diff(runs):.2e}",
             f"wall time per run: stock {runs['stock']['seconds']:.0f} s, flash {runs['flash']['seconds']:.0f} s "
             f"(2 ranks on a shared CPU over loopback gloo, start-up included: not a speed claim)"]
    return "\n".join(rows)


def max_diff(runs: dict) -> float:
    return max(abs(a - b) for a, b in zip(runs["stock"]["loss"], runs["flash"]["loss"]))


def plot(runs: dict, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for arm, style, label in (("stock", "o-", "stock (local spec)"), ("flash", "x--", "--flash-overlap (configs/flash.yaml)")):
        loss = runs[arm]["loss"]
        ax.plot(range(1, len(loss) + 1), loss, style, ms=4, label=label)
    ax.set(xlabel="iteration", ylabel="lm loss (Megatron's log)", title=title)
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--model", choices=sorted(STYLES), default="gpt2")
    p.add_argument("--plot", default=os.path.join("results", "pretrain_tiny_gpt.png"))
    p.add_argument("--json", default=None, help="also write both curves as JSON here")
    p.add_argument("--timeout", type=float, default=300, help="seconds per run before it is killed")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse(argv)
    print(f"Megatron's pretrain() on mock data, tiny {args.model}-style GPT (2 layers, hidden 64), TP=2 + SP "
          f"on 2 CPU ranks (gloo), {args.iters} iterations: stock, then --flash-overlap with configs/flash.yaml",
          flush=True)
    t0 = time.perf_counter()
    runs = {arm: train(arm, args.iters, args.model, args.timeout) for arm in ("stock", "flash")}
    print(report(runs))
    plot(runs, args.plot, f"Megatron pretrain(), tiny {args.model}, TP=2 + SP, 2 CPU ranks")
    print(f"plot: {args.plot}   (total {time.perf_counter() - t0:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**runs, "max_diff": max_diff(runs)}, f)
    return runs


if __name__ == "__main__":
    main()
