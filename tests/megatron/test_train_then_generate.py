"""examples/train_then_generate.py, short: Megatron's pretrain() saves a tiny GPT (TP=2, 2 CPU ranks), then the
project's inference entry (megatron/cli/generate.py: MegatronLLM, the dynamic engine) generates from it, stock and
--flash-overlap. Tier 2 (three torchrun subprocesses; newest lane: megatron.training and the high-level
inference API ship in the 0.19 wheel). Exact: greedy tokens and their log-probs are compared to the bit (same
weights, same core attention; each TP all-reduce sums two partials, a + b == b + a)."""
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from examples import train_then_generate  # noqa: E402

PROMPTS, TOKENS = 4, 6
SITES = ("GEMM sites: dense[1-2]: qkv=flash (all-reduce, no SP), proj=flash (all-reduce, no SP), "
         "fc1=flash (all-reduce, no SP), fc2=flash (all-reduce, no SP)")


@pytest.mark.newest_only
def test_generation_from_a_pretrain_checkpoint_is_identical_with_flash_overlap(tmp_path, capsys):
    runs = train_then_generate.main(["--iters", "2", "--prompts", str(PROMPTS), "--tokens", str(TOKENS),
                                     "--workdir", str(tmp_path)])
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
