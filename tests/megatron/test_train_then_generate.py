"""examples/train_then_generate.py, short: Megatron's pretrain() saves a tiny GPT (TP=2, 2 CPU ranks), then the
project's inference entry (megatron/cli/generate.py: MegatronLLM, the dynamic engine) generates from it, stock and
--flash-overlap. Tier 2 (newest lane: megatron.training and the high-level inference API ship in the 0.19
wheel). The example's three runs are its exact per-rank commands (`train_args`, `generate_args`) run in the
session's shared start-up (the `pretrain` fixture, jobs in that order); the example's own code builds each
command and reads what the entries printed and wrote (`from_batch` checks each command is the entry on 2 ranks
with those arguments). Exact: greedy tokens and their log-probs are compared to the bit (same weights, same core
attention; each TP all-reduce sums two partials, a + b == b + a)."""
import sys
from pathlib import Path

import pytest

from tests.support.pretrain_runs import AFTER, Job, from_batch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from examples import train_then_generate  # noqa: E402

ITERS, PROMPTS, TOKENS = 2, 4, 6
WORK = "{tmp}/train-then-generate"
ARGS = {"train": tuple(train_then_generate.train_args(f"{WORK}/ckpt", ITERS))}
ARGS.update({arm: tuple(train_then_generate.generate_args(arm, f"{WORK}/ckpt", PROMPTS, TOKENS, f"{WORK}/{arm}.json"))
             for arm in ("stock", "flash")})
JOBS = [Job("ttg-train", "pretrain_gpt", ("--cpu", *ARGS["train"])),  # before both generations (order)
        *(Job(f"ttg-{arm}", "generate", ("--cpu", *ARGS[arm]), order=AFTER) for arm in ("stock", "flash"))]
SITES = ("GEMM sites: dense[1-2]: qkv=auto (all-reduce, no SP), proj=auto (all-reduce, no SP), "
         "fc1=auto (all-reduce, no SP), fc2=auto (all-reduce, no SP)")  # the flag's default word


@pytest.mark.newest_only
@pytest.mark.pretrain(*JOBS)
def test_generation_from_a_pretrain_checkpoint_is_identical_with_flash_overlap(capsys, monkeypatch, pretrain):
    monkeypatch.setattr(train_then_generate, "subprocess", from_batch(pretrain, "ttg", ARGS))
    work = WORK.replace("{tmp}", str(pretrain.tmp))
    runs = train_then_generate.main(["--iters", str(ITERS), "--prompts", str(PROMPTS), "--tokens", str(TOKENS),
                                     "--workdir", work])
    printed = capsys.readouterr().out
    stock, flash = runs["stock"]["requests"], runs["flash"]["requests"]
    assert len(stock) == len(flash) == PROMPTS
    assert len({len(r["prompt"]) for r in stock}) > 1, "prompts of mixed lengths"
    for s, f in zip(stock, flash):
        assert s["prompt"] == f["prompt"] and len(s["tokens"]) == TOKENS and len(s["log_probs"]) == TOKENS
        assert s["tokens"] == f["tokens"] and s["log_probs"] == f["log_probs"]
    assert runs["stock"]["sites"] == "GEMM sites: stock"
    assert runs["flash"]["sites"] == SITES  # ours ran
    assert "tokens and log-probs identical for every request: True" in printed
