"""The one timing loop of every benchmark: variants interleaved per round, warm-up rounds dropped.

    samples = interleaved({"stock": lambda: timed(f), "flash": lambda: timed(g)}, rounds=5)
    samples = rank_max(samples)                  # a round lasts as long as its slowest rank
    median = statistics.median(samples["flash"])  # a figure = the median over rounds (the caller's statistic)

    round 0 (warm-up) | stock flash | dropped
    round 1           | stock flash |  rotate=True: round r starts at variant r mod len (flash stock)
    ...
A variant is a callable that runs ONE measured call and returns its seconds: `timed` (host clock, after a
barrier of the default group; `sync` waits for the device), `cuda_timed` (CUDA events), or `pass_seconds`
(one forward, or forward + backward, of a block: fresh leaf input before the clock, grads dropped after).
"""
from __future__ import annotations

import time
from typing import Callable, Hashable, Mapping

import torch
import torch.distributed as dist

from ..runtime.clock import cuda_timed  # noqa: F401 - the loop's CUDA-event variant (runtime: the probe uses it too)


def timed(fn: Callable[[], object], *, barrier: bool = True, sync: Callable[[], None] | None = None,
          group=None) -> float:
    """Seconds of one fn() on the host clock; every rank starts after a barrier when `barrier` and a group
    is up; `sync` (e.g. torch.cuda.synchronize) runs inside the clock, after fn."""
    if barrier and dist.is_initialized():
        dist.barrier(group)
    t0 = time.perf_counter()
    fn()
    if sync is not None:
        sync()
    return time.perf_counter() - t0


def pass_seconds(forward: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, mode: str,
                 dy: torch.Tensor | None = None, params=()) -> float:
    """`timed` forward(x) ("fwd") or forward(x) then backward(dy) ("fwd+bwd"; dy None: y itself, detached)
    on a fresh leaf copy of x; the grads of `params` are dropped afterwards, outside the clock."""
    x = x.detach().requires_grad_(mode != "fwd")

    def run():
        y = forward(x)
        if mode != "fwd":
            y.backward(y.detach() if dy is None else dy)
    dt = timed(run)
    for p in params:
        p.grad = None
    return dt


def interleaved(variants: Mapping[Hashable, Callable[[], float]], rounds: int, *, warmup: int = 1,
                rotate: bool = False, tick: Callable[[], None] | None = None) -> dict[Hashable, list[float]]:
    """{key: [seconds per kept round]}: `warmup + rounds` rounds, each runs every variant once, in mapping
    order (rotated by the round index when `rotate`); `tick()` after every variant call."""
    if rounds < 1 or warmup < 0:
        raise ValueError(f"interleaved: rounds={rounds}, warmup={warmup}; ask for rounds >= 1 and warmup >= 0")
    keys = list(variants)
    out: dict[Hashable, list[float]] = {k: [] for k in keys}
    for r in range(warmup + rounds):
        k0 = r % len(keys) if rotate else 0
        for key in keys[k0:] + keys[:k0]:
            seconds = variants[key]()
            if r >= warmup:
                out[key].append(seconds)
            if tick:
                tick()
    return out


def rank_max(samples: Mapping[Hashable, list[float]], group=None) -> dict[Hashable, list[float]]:
    """Per key and round, the max over the ranks of `group` (every rank holds the same keys and rounds)."""
    keys = list(samples)
    if not dist.is_initialized() or not keys:
        return {k: list(samples[k]) for k in keys}
    t = torch.tensor([samples[k] for k in keys], dtype=torch.float64)  # [keys, rounds]
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return dict(zip(keys, t.tolist()))
