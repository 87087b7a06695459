"""The one estimator of every benchmark table: medians over interleaved rounds, bootstrap intervals.

    point(block, compute, comm) -> {"block", "compute", "comm", "exposed", "hidden", "bound"}
        block    median(block)                              (each list: seconds per kept round)
        exposed  median(block) - median(compute alone)      (a difference of medians, never the median of
                                                             per-round differences: the two differ by
                                                             tens of percent on a loaded box)
        hidden   1 - exposed / median(comm alone)
        bound    median(block) / max(median(compute), median(comm))
    estimate(block, compute, comm) -> point(...) plus "<name>_ci": (lo, hi) for hidden and bound
    speedup(base, other) -> {"ratio": median(base) / median(other), "ci": (lo, hi), "win", "loss"}
        win: the interval lies above 1.0 (other is faster beyond doubt); loss: below 1.0

Intervals: a percentile bootstrap (LEVEL = 90 %) that resamples ROUND INDICES, the same indices for every
list of one estimate: rounds are interleaved (every variant runs once per round), so a load burst that
hits one round hits all its variants, and resampling rounds keeps that pairing. Deterministic (SEED).
"""
from __future__ import annotations

import functools
import random
import statistics
from typing import Callable, Sequence

import numpy as np

LEVEL = 0.90
RESAMPLES = 2000
SEED = 0


def _check(*lists: Sequence[float]) -> int:
    n = len(lists[0])
    if n < 1 or any(len(s) != n for s in lists):
        raise ValueError(f"estimator: sample lists of lengths {[len(s) for s in lists]}; pass one sample per "
                         f"kept round for every variant (equal, non-zero lengths: runtime/timing.interleaved)")
    return n


def point(block: Sequence[float], compute: Sequence[float], comm: Sequence[float]) -> dict:
    """The table's figures from per-round seconds (module docstring)."""
    _check(block, compute, comm)
    b, c, m = statistics.median(block), statistics.median(compute), statistics.median(comm)
    exposed = b - c
    return {"block": b, "compute": c, "comm": m, "exposed": exposed,
            "hidden": 1.0 - exposed / m if m > 0 else float("nan"), "bound": b / max(c, m)}


@functools.lru_cache(maxsize=16)
def _resampled_rounds(n: int, resamples: int, seed: int) -> tuple[tuple[int, ...], ...]:
    """The round indices of every resample: one seeded draw per (n, resamples, seed), shared by every estimate
    of that many rounds (the draws do not depend on the samples, and a table makes hundreds of estimates)."""
    rng = random.Random(seed)
    return tuple(tuple(rng.randrange(n) for _ in range(n)) for _ in range(resamples))


def _medians(rows: np.ndarray) -> np.ndarray:
    """statistics.median of every row of [resamples, n] (the middle value, or the mean of the two middle ones)."""
    s, n = np.sort(rows, axis=1), rows.shape[1]
    return s[:, n // 2] if n % 2 else (s[:, n // 2 - 1] + s[:, n // 2]) / 2


@functools.lru_cache(maxsize=16)
def _rounds_array(n: int, resamples: int, seed: int) -> np.ndarray:
    """_resampled_rounds as one [resamples, n] index array."""
    return np.asarray(_resampled_rounds(n, resamples, seed))


def bootstrap(stat: Callable[..., float], *lists: Sequence[float], level: float = LEVEL,
              resamples: int = RESAMPLES, seed: int = SEED) -> tuple[float, float]:
    """(lo, hi): the central `level` percentile interval of stat(*lists) over round-index resamples."""
    n = _check(*lists)
    vals = [stat(*([s[i] for i in idx] for s in lists)) for idx in _resampled_rounds(n, resamples, seed)]
    vals.sort()
    tail = (1.0 - level) / 2
    return vals[int(tail * (resamples - 1))], vals[int((1.0 - tail) * (resamples - 1) + 0.5)]


def estimate(block: Sequence[float], compute: Sequence[float], comm: Sequence[float], **kw) -> dict:
    """point(...) with "hidden_ci" and "bound_ci" (bootstrap intervals, module docstring)."""
    out = point(block, compute, comm)
    for name in ("hidden", "bound"):
        out[f"{name}_ci"] = bootstrap(lambda b, c, m, k=name: point(b, c, m)[k], block, compute, comm, **kw)
    return out


def speedup(base: Sequence[float], other: Sequence[float], level: float = LEVEL, resamples: int = RESAMPLES,
            seed: int = SEED) -> dict:
    """median(base) / median(other) with its bootstrap interval; win / loss where it excludes 1.0. The interval is
    `bootstrap`'s over the ratio of medians, the resamples' medians taken in one numpy call per list (the same
    values: a median is the middle sample, or the mean of the two middle ones)."""
    n = _check(base, other)
    idx = _rounds_array(n, resamples, seed)  # [resamples, n]
    ratios = _medians(np.asarray(base, dtype=float)[idx]) / _medians(np.asarray(other, dtype=float)[idx])
    vals = np.sort(ratios).tolist()
    tail = (1.0 - level) / 2
    lo, hi = vals[int(tail * (resamples - 1))], vals[int((1.0 - tail) * (resamples - 1) + 0.5)]
    ratio = statistics.median(base) / statistics.median(other)
    return {"ratio": ratio, "ci": (lo, hi), "win": lo > 1.0, "loss": hi < 1.0}
