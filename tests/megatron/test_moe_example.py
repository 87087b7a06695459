"""examples/pretrain_tiny_moe.py, short: Megatron's pretrain() through the project entry, a tiny MoE GPT (4 experts,
top-2, alltoall dispatcher, aux loss), EP=2 on 2 CPU ranks, stock vs ours with the default (fused) algorithm; the
unfused algorithms' numerics against stock are tests/megatron/test_moe_gpt.py's
(test_moe_gpt_unfused_algos_match_stock). Tier 2 (the example's runs are its exact per-rank commands, in the
session's shared start-up: see tests/megatron/test_example.py). Newest lane only: megatron.training ships in the
0.19 wheel, and megatron-core 0.16.1's router needs Transformer Engine (tests/megatron/test_moe_gpt.py). Asserts
curves and what the example prints, never timing."""
import json
import math
import sys
from pathlib import Path

import pytest

from tests.support.pretrain_runs import Job, from_batch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from examples import pretrain_tiny_gpt, pretrain_tiny_moe  # noqa: E402
from megatron_flashoverlap.config import MOE_ALGOS  # noqa: E402

# The exchange moves rows exactly (tests/gloo/test_moe_exchange.py) and TP = 1; an algorithm that runs the experts
# block by block sums their weight gradients in another order; 4 Adam steps of that stay far inside 1e-5 relative
# (measured: 0).
RTOL = 1e-5
ITERS = 4
ALGO = "flash"  # the fused exchange (the default, auto, measures it against stock)
YAML = {ALGO: (f"moe_{ALGO}.yaml", f"moe: {{algo: {ALGO}}}\n")}  # what the example writes for --algos ALGO
ARGS = {"stock": tuple(pretrain_tiny_moe.moe_args(ITERS)),
        ALGO: (*pretrain_tiny_moe.moe_args(ITERS), "--flash-overlap", "--flash-overlap-config",
               f"{{tmp}}/{YAML[ALGO][0]}")}
JOBS = [Job(f"moe-example-{arm}", "pretrain_gpt", ("--cpu", *args), files=tuple(YAML.values()) if arm == ALGO else ())
        for arm, args in ARGS.items()]

pytestmark = pytest.mark.newest_only


@pytest.mark.pretrain(*JOBS)
def test_tiny_moe_curves_match_stock(tmp_path, capsys, monkeypatch, pretrain):
    monkeypatch.setattr(pretrain_tiny_gpt, "subprocess", from_batch(pretrain, "moe-example", ARGS, YAML))
    js = tmp_path / "curves.json"
    runs = pretrain_tiny_moe.main(["--iters", str(ITERS), "--algos", ALGO, "--json", str(js)])
    printed = capsys.readouterr().out
    stock = runs["stock"]["loss"]
    assert list(runs) == ["stock", ALGO]
    assert len(stock) == ITERS and all(math.isfinite(x) for x in stock)
    assert stock[-1] < stock[0], "Megatron's loop really trained: the loss falls"
    assert runs["stock"]["sites"] == "GEMM sites: stock"
    ours = runs[ALGO]["loss"]
    assert len(ours) == ITERS
    assert all(abs(a - b) <= RTOL * abs(a) for a, b in zip(stock, ours)), (ALGO, stock, ours)
    assert f"ep_a2a={ALGO}" in runs[ALGO]["sites"], runs[ALGO]["sites"]  # our dispatcher ran, with this algo
    assert f"max |lm loss stock - lm loss {ALGO}| over {ITERS} iterations" in printed
    assert f"{ITERS:4d}  {stock[-1]:17.6f}" in printed  # the side-by-side table
    assert max(json.loads(js.read_text())["max_diff"].values()) <= RTOL * max(stock)


def test_algos_flag_names_the_words():
    assert pretrain_tiny_moe.parse([]).algos == MOE_ALGOS
    assert pretrain_tiny_moe.parse(["--algos", "exchange,flash"]).algos == ("exchange", "flash")
    with pytest.raises(SystemExit):
        pretrain_tiny_moe.parse(["--algos", "fast"])
