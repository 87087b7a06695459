"""Megatron's own training loop on CPU: `pretrain()` through the project entry and through the launcher.

Tier 2 (2 ranks under torchrun, one subprocess per run; newest lane: the 0.16.1 wheel has no megatron.training).
Each run: 8 iterations of a tiny GPT, TP=2 + SP on 2 CPU gloo ranks, Megatron's default flags otherwise (the
CPU ones come from `--cpu`); stock vs `--flash-overlap` must log the same `lm loss`. GPT-2 style through the
entry is tests/megatron/test_example.py (the demo); here the Llama style (RMSNorm, SwiGLU, RoPE, untied
embeddings, no bias) through the launcher running a script of the tests' own (tests/megatron/pretrain_script.py).
Each run costs ~10-20 s of start-up on 2 cores, so each style runs once, on one path; the paths share every
step but the script (launch.prepare).
"""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("pretrain_script.py")
ITERS = 8
# TP=2: each reduce-scatter / all-reduce sums two partials (a+b == b+a in fp32), so identical curves are
# expected; 1e-5 relative leaves room for BLAS choosing another kernel for the sliced GEMMs (reordered dots).
RTOL = 1e-5
TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "2",
        "--tensor-model-parallel-size", "2", "--sequence-parallel", "--train-iters", str(ITERS), "--lr", "1e-3",
        "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "1000", "--tokenizer-type",
        "NullTokenizer", "--vocab-size", "128", "--mock-data", "--seed", "1234"]
STYLES = {"llama": ["--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope",
                    "--untie-embeddings-and-output-weights", "--disable-bias-linear"]}


def run(head: list, style: str, flash: bool) -> tuple:
    """-> ({iteration: lm loss}, the GEMM sites line or None), from Megatron's own log on rank 0."""
    cmd = [sys.executable, "-m", *head, *TINY, *STYLES[style], *(["--flash-overlap"] if flash else [])]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    losses = {int(i): float(v) for i, v in re.findall(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.E+-]+)",
                                                       proc.stdout)}
    sites = [ln for ln in proc.stdout.splitlines() if ln.startswith("GEMM sites: ")]
    return losses, (sites[-1] if sites else None)


def assert_same_curve(stock: dict, flash: dict) -> None:
    assert sorted(stock) == sorted(flash) == list(range(1, ITERS + 1)), (stock, flash)
    for i in stock:
        assert abs(stock[i] - flash[i]) <= RTOL * abs(stock[i]), (i, stock[i], flash[i])
    assert stock[ITERS] < stock[1], "the loss must fall: Megatron really trained"


@pytest.mark.newest_only
def test_launcher_runs_an_unmodified_pretrain_script_on_cpu():
    """torchrun ... -m megatron_flashoverlap.launch --cpu SCRIPT, the per-rank form users type."""
    head = ["torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "megatron_flashoverlap.launch",
            "--cpu", str(SCRIPT)]
    stock, _ = run(head, "llama", flash=False)
    flash, _ = run(head, "llama", flash=True)
    assert_same_curve(stock, flash)
