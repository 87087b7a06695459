"""Tier 1 (pure): the sweep verdict reports every point, losses included, a win only outside the interval."""
from benchmarks.harness import verdict as v
from benchmarks.harness.estimator import estimate


def _row(method, seq, block, compute=(1.0,) * 5, comm=(0.5,) * 5):
    return {"kind": "mlp", "mode": "fwd", "seq": seq, "method": method, "samples": list(block),
            **estimate(block, compute, comm)}


def _run():
    fast, slow, same = [1.0, 1.05, 0.95, 1.02, 0.98], [2.0, 2.1, 1.9, 2.05, 1.95], [1.0, 1.2, 0.9, 1.1, 1.05]
    rows = [_row("stock", 64, slow), _row("slicing k=2", 64, slow), _row("flash", 64, fast),   # a win
            _row("stock", 128, fast), _row("slicing k=2", 128, same), _row("flash", 128, slow),  # a loss
            _row("stock", 256, same), _row("slicing k=2", 256, slow), _row("flash", 256, fast)]  # tie vs stock
    return {"rate": "2gbit", "config": {"seqs": [64, 128, 256], "kinds": ["mlp"]}, "rows": rows}


def test_every_point_has_a_row_and_losses_are_named():
    lines = v.verdict(_run(), "mlp", "fwd")
    assert len(lines) == 3
    assert "win" in lines[0] and "LOSS" in lines[1]


def test_summary_counts_wins_ties_losses():
    stock, slicing = v.summary([_run()])
    assert "1 wins, 1 ties (interval contains 1.0), 1 losses of 3 points" in stock
    assert "losses at 2gbit mlp fwd s=128" in stock
    assert "2 wins, 0 ties (interval contains 1.0), 1 losses of 3 points" in slicing
