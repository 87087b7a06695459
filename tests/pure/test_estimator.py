"""Tier 1 (pure): the one estimator of the benchmark tables (benchmarks/harness/estimator.py).

Expected values are worked by hand from the samples; the interval tests use simulated rounds of known
distributions. Tolerances: 1e-12 where the figure is a difference or ratio of two sample values (one
rounding each).
"""
import random

import pytest

from benchmarks.harness import estimator as est


def test_exposed_is_a_difference_of_medians_not_a_median_of_differences():
    block, compute, comm = [10.0, 20.0, 30.0], [9.0, 5.0, 29.0], [4.0, 8.0, 22.0]
    p = est.point(block, compute, comm)
    # medians: block 20, compute 9, comm 8 (per-round differences 1, 15, 1 would give 1)
    assert p["exposed"] == pytest.approx(11.0, abs=1e-12)
    assert p["hidden"] == pytest.approx(1.0 - 11.0 / 8.0, abs=1e-12)
    assert p["bound"] == pytest.approx(20.0 / 9.0, abs=1e-12)


def test_fully_hidden_comm_and_the_bound():
    p = est.point([5.0, 5.0, 5.0], [5.0, 5.0, 5.0], [3.0, 3.0, 3.0])
    assert p["hidden"] == 1.0 and p["bound"] == 1.0  # exact: 5 - 5 and 5 / 5


def test_constant_rounds_give_a_point_interval():
    e = est.estimate([6.0] * 5, [4.0] * 5, [4.0] * 5)
    assert e["hidden_ci"] == (0.5, 0.5) and e["bound_ci"] == (1.5, 1.5)  # exact: 1 - 2/4, 6/4


def test_a_clear_speedup_is_a_win_and_its_inverse_a_loss():
    base, fast = [2.0, 2.1, 1.9, 2.05, 1.95], [1.0, 1.1, 0.95, 1.05, 1.0]
    s = est.speedup(base, fast)
    assert s["win"] and not s["loss"] and s["ci"][0] <= s["ratio"] <= s["ci"][1]
    assert est.speedup(fast, base)["loss"]


def test_overlapping_rounds_are_neither_win_nor_loss():
    a, b = [1.0, 1.2, 0.9, 1.1, 1.05], [1.1, 0.95, 1.0, 1.15, 1.02]
    s = est.speedup(a, b)
    assert s["ci"][0] < 1.0 < s["ci"][1] and not s["win"] and not s["loss"]


def test_interval_covers_the_true_ratio_most_of_the_time():
    rng, hits, trials = random.Random(1), 0, 150
    for t in range(trials):  # both variants from one distribution: the true ratio of medians is 1
        a = [rng.gauss(1.0, 0.1) for _ in range(15)]
        b = [rng.gauss(1.0, 0.1) for _ in range(15)]
        lo, hi = est.speedup(a, b, resamples=300, seed=t)["ci"]
        hits += lo <= 1.0 <= hi
    assert hits / trials >= 0.75  # nominal 90 %; a percentile bootstrap of 15 rounds under-covers a little


def test_the_interval_is_deterministic():
    a, b = [1.0, 1.3, 0.8, 1.1], [0.9, 1.0, 1.2, 1.05]
    assert est.speedup(a, b) == est.speedup(a, b)


@pytest.mark.parametrize("lists", [([], [], []), ([1.0, 2.0], [1.0], [1.0, 2.0])])
def test_bad_sample_lists_are_refused(lists):
    with pytest.raises(ValueError, match="one sample per kept round"):
        est.estimate(*lists)
