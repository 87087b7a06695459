"""The README's main job (examples/pretrain_tiny_gpt.py, `make demo`), short: Megatron's pretrain() through the
project entry, stock vs --flash-overlap, tiny GPT-2-style model, TP=2 + SP on 2 CPU ranks.
Tier 2 (newest lane: megatron.training ships in the 0.19 wheel). Asserts the curves match and what the demo
prints, never timing. The demo's two runs are its exact per-rank commands (`megatron_args` + --flash-overlap,
under the project entry with --cpu) run in the session's shared start-up (the `pretrain` fixture); the demo's
`run_entry` builds its command and parses the output as ever, only the launch is the batch's (`from_batch`
checks the command is the entry on 2 ranks with those arguments)."""
import json
import math
import sys
from pathlib import Path

import pytest

from tests.support.pretrain_runs import Job, from_batch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from examples import pretrain_tiny_gpt  # noqa: E402

# TP=2: every reduce-scatter / all-reduce sums two partials, and a+b == b+a in fp32, so the curves are
# expected identical; 1e-5 relative leaves room for the BLAS picking another kernel for the sliced GEMMs.
RTOL = 1e-5
ITERS = 8
SITES = "qkv=flash, proj=flash, fc1=flash, fc2=flash"
ARGS = {"stock": tuple(pretrain_tiny_gpt.megatron_args(ITERS, "gpt2"))}
ARGS["flash"] = (*ARGS["stock"], *pretrain_tiny_gpt.FLASH)
JOBS = [Job(f"demo-{arm}", "pretrain_gpt", ("--cpu", *args)) for arm, args in ARGS.items()]


@pytest.mark.newest_only
@pytest.mark.pretrain(*JOBS)
def test_demo_curves_match(tmp_path, capsys, monkeypatch, pretrain):
    monkeypatch.setattr(pretrain_tiny_gpt, "subprocess", from_batch(pretrain, "demo", ARGS))
    plot, js = tmp_path / "curves.png", tmp_path / "curves.json"
    runs = pretrain_tiny_gpt.main(["--iters", str(ITERS), "--plot", str(plot), "--json", str(js)])
    printed = capsys.readouterr().out
    stock, flash = runs["stock"]["loss"], runs["flash"]["loss"]
    assert len(stock) == len(flash) == ITERS and all(math.isfinite(x) for x in stock + flash)
    for a, b in zip(stock, flash):
        assert abs(a - b) <= RTOL * abs(a), (a, b)
    assert stock[-1] < stock[0], "Megatron's loop really trained: the loss falls"
    assert runs["stock"]["sites"] == "GEMM sites: stock"
    assert runs["flash"]["sites"] == f"GEMM sites: dense[1-2]: {SITES}"  # ours ran
    assert f"{ITERS:4d}  {stock[-1]:13.6f}  {flash[-1]:13.6f}" in printed  # the side-by-side table
    assert f"--flash-overlap GEMM sites: dense[1-2]: {SITES}" in printed and f"plot: {plot}" in printed
    assert plot.stat().st_size > 0 and json.loads(js.read_text())["max_diff"] <= RTOL * max(stock)
    # the README's sample is what the demo prints: its first row (before any update, so independent of the
    # iteration count and the LR schedule) and the sites line
    readme = (ROOT / "README.md").read_text()
    assert f"   1  {stock[0]:13.6f}  {flash[0]:13.6f}" in readme, "README.md's demo sample is stale: re-run make demo"
    assert f"--flash-overlap GEMM sites: dense[1-2]: {SITES}" in readme
