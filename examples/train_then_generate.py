"""Train a tiny GPT with Megatron's pretrain(), save it, then generate from the checkpoint: stock and
`--flash-overlap` side by side, TP=2 on 2 CPU ranks (gloo). The generated tokens must be identical.

    python -m megatron_flashoverlap.pretrain_gpt --cpu --nproc-per-node 2 <tiny GPT> --save CKPT   (train, stock)
    python -m megatron_flashoverlap.generate --cpu --nproc-per-node 2 <tiny GPT> --load CKPT ...     stock
    python -m megatron_flashoverlap.generate --cpu --nproc-per-node 2 <tiny GPT> --load CKPT ... \\
        --flash-overlap                                                                                     ours

Generation is Megatron's dynamic inference engine behind its high-level API (MegatronLLM), greedy, on prompts
of mixed lengths (random token ids: the tiny model has Megatron's NullTokenizer). A checkpoint saved by a stock
run serves --flash-overlap as it is (same parameters, same names). Three short torchrun starts; a couple of
minutes on 2 cores.

    python examples/train_then_generate.py [--iters 10] [--prompts 6] [--tokens 12] [--workdir DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
         "--max-position-embeddings", "64", "--tensor-model-parallel-size", "2", "--tokenizer-type",
         "NullTokenizer", "--vocab-size", "128", "--seed", "1234"]
# a small learning rate: after a few steps on mock data the model still answers differently per prompt
TRAIN = ["--micro-batch-size", "2", "--global-batch-size", "2", "--lr", "1e-4", "--log-interval", "1",
         "--eval-iters", "0", "--eval-interval", "1000000", "--mock-data"]


def run(module: str, args: list[str], what: str, timeout: float) -> tuple[str, float]:
    """`python -m module --cpu --nproc-per-node 2 args` -> (stdout, seconds); a failure raises with its log."""
    cmd = [sys.executable, "-m", module, "--cpu", "--nproc-per-node", "2", *args]
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed (exit {proc.returncode}): {' '.join(cmd)}\n{proc.stdout[-2000:]}"
                           f"\n{proc.stderr[-4000:]}")
    return proc.stdout, time.perf_counter() - t0


def train_args(ckpt: str, iters: int) -> list[str]:
    """The training run's per-rank arguments: `iters` steps of the tiny GPT, `ckpt` saved at the last."""
    return [*MODEL, *TRAIN, "--train-iters", str(iters), "--save", ckpt, "--save-interval", str(iters)]


def generate_args(arm: str, ckpt: str, prompts: int, tokens: int, out: str) -> list[str]:
    """One generation run's per-rank arguments (arm "stock" or "flash"): `prompts` random prompts of 3-29
    tokens, `tokens` greedy tokens each, the requests written to `out`."""
    return [*MODEL, "--micro-batch-size", "1", "--load", ckpt, "--num-prompts", str(prompts),
            "--prompt-length-range", "3", "29", "--num-tokens-to-generate", str(tokens), "--output-path", out,
            *(["--flash-overlap"] if arm == "flash" else [])]


def train(ckpt: str, iters: int, timeout: float) -> float:
    """Megatron's pretrain() (stock), saving `ckpt` at the last iteration; -> seconds."""
    return run("megatron_flashoverlap.pretrain_gpt", train_args(ckpt, iters), "training", timeout)[1]


def generate(arm: str, ckpt: str, opts: argparse.Namespace, out: str) -> dict:
    """One generation run from `ckpt`; -> {"requests": [{prompt, tokens, log_probs}], "sites", "seconds"}."""
    args = generate_args(arm, ckpt, opts.prompts, opts.tokens, out)
    stdout, seconds = run("megatron_flashoverlap.generate", args, f"{arm} generation", opts.timeout)
    sites = [ln for ln in stdout.splitlines() if ln.startswith("GEMM sites: ")]
    with open(out) as f:
        return {"requests": json.load(f), "sites": sites[-1] if sites else "GEMM sites: ?", "seconds": seconds}


def report(runs: dict) -> str:
    """Per request: prompt length, the tokens of each arm, and whether they are the same."""
    rows = []
    for i, (s, f) in enumerate(zip(runs["stock"]["requests"], runs["flash"]["requests"])):
        same = "same" if s["tokens"] == f["tokens"] and s["log_probs"] == f["log_probs"] else "DIFFERENT"
        rows += [f"request {i} (prompt {len(s['prompt']):2d} tokens) {same}",
                 f"  stock:           {' '.join(map(str, s['tokens']))}",
                 f"  --flash-overlap: {' '.join(map(str, f['tokens']))}"]
    rows += ["", f"--flash-overlap {runs['flash']['sites']}",
             f"tokens and log-probs identical for every request: {identical(runs)}",
             f"wall time per generation run: stock {runs['stock']['seconds']:.0f} s, flash "
             f"{runs['flash']['seconds']:.0f} s (start-up and checkpoint load included: not a speed claim)"]
    return "\n".join(rows)


def identical(runs: dict) -> bool:
    return runs["stock"]["requests"] == runs["flash"]["requests"]


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--iters", type=int, default=10, help="training iterations before the checkpoint is saved")
    p.add_argument("--prompts", type=int, default=6, help="random prompts, lengths 3 to 29 tokens")
    p.add_argument("--tokens", type=int, default=12, help="tokens to generate per prompt")
    p.add_argument("--workdir", default=None, help="checkpoint and outputs here (default: a temporary folder)")
    p.add_argument("--timeout", type=float, default=400, help="seconds per run before it is killed")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    opts = parse(argv)
    with tempfile.TemporaryDirectory() as tmp:
        work = opts.workdir or tmp
        ckpt = os.path.join(work, "ckpt")
        print(f"training a tiny GPT ({opts.iters} iterations of Megatron's pretrain(), TP=2 on 2 CPU ranks), "
              f"saving {ckpt}", flush=True)
        seconds = train(ckpt, opts.iters, opts.timeout)
        print(f"trained and saved in {seconds:.0f} s; generating {opts.tokens} tokens for {opts.prompts} prompts: "
              f"stock, then --flash-overlap", flush=True)
        runs = {arm: generate(arm, ckpt, opts, os.path.join(work, f"{arm}.json")) for arm in ("stock", "flash")}
    print(report(runs))
    return runs


if __name__ == "__main__":
    main()
