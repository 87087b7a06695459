"""Tier 1 (pure): the MoE benchmark's table (benchmarks/moe/table.py): every row printed, stock's exchange share, a win
only where the speedup interval excludes 1.0, losses named in the summary. Inputs are hand-made samples."""
import pytest

from benchmarks.moe import table as t
from benchmarks.harness.estimator import estimate

FAST, SLOW, NOISY = [1.0, 1.05, 0.95, 1.02, 0.98], [2.0, 2.1, 1.9, 2.05, 1.95], [1.0, 3.0, 0.5, 2.5, 0.8]


def _row(method, mode, block, compute=(0.8,) * 5, comm=(0.5,) * 5):
    return {"method": method, "mode": mode, "samples": list(block), "spread": (min(block), max(block)),
            **estimate(block, compute, comm)}


def _run(world=2, rate="tbf 1gbit"):
    rows = [_row("stock", "fwd", SLOW), _row("stock", "fwd+bwd", FAST),
            _row("flash", "fwd", FAST), _row("flash", "fwd+bwd", SLOW),      # a win, then a loss
            _row("reference", "fwd", NOISY), _row("reference", "fwd+bwd", FAST)]
    cfg = {"tokens": 2048, "hidden": 512, "ffn": 1024, "experts": 8, "topk": 2, "repeats": 5}
    return {"world": world, "rate": rate, "config": cfg, "rows": rows}


def test_every_row_printed_with_its_verdict():
    lines = t.table(_run()).splitlines()[2:]
    assert len(lines) == 6
    assert lines[0].startswith("| stock | fwd | 2000.0 (1900.0-2100.0) | 800.0 | 500.0 | 1200.0 |")
    assert lines[0].endswith("| - |")
    assert "2.00x" in lines[2] and lines[2].endswith("win |")           # 2.0 / 1.0, interval above 1
    assert "0.50x" in lines[3] and lines[3].endswith("LOSS |")          # 1.0 / 2.0, interval below 1
    assert lines[4].endswith("tie |")                                   # spread over 1.0 both ways


def test_hidden_and_bound_follow_the_estimator():
    # stock fwd: block 2.0, compute 0.8, comm 0.5: exposed 1.2, hidden 1 - 1.2 / 0.5 = -140 %, bound 2.0 / 0.8
    line = t.table(_run()).splitlines()[2]
    assert "| -140% [" in line and "| 2.50x [" in line


def test_share_is_stock_comm_over_stock_block():
    assert t.share(_run(), "fwd") == pytest.approx(0.5 / 2.0)
    assert t.share(_run(), "fwd+bwd") == pytest.approx(0.5 / 1.0)


def test_header_says_when_ranks_share_cores():
    assert "share this machine's cores" not in t.header(_run(2))
    h = t.header(_run(4))
    assert "EP=4" in h and "4 ranks share this machine's cores" in h and "fwd 25%, fwd+bwd 50%" in h


def test_summary_counts_and_names_losses():
    flash, ref = t.summary([_run(2), _run(4, "tbf 2gbit")])
    assert flash.startswith("- flash vs stock: 2 wins, 0 ties (interval contains 1.0), 2 losses of 4 points")
    assert "losses at EP=2 tbf 1gbit fwd+bwd, EP=4 tbf 2gbit fwd+bwd" in flash
    assert ref.startswith("- reference vs stock:") and "2 wins" not in ref


def test_a_run_without_stock_is_refused():
    run = _run()
    run["rows"] = [r for r in run["rows"] if r["method"] != "stock"]
    with pytest.raises(ValueError, match="no stock row"):
        t.table(run)
