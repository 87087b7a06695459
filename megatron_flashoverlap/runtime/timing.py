"""The package's one timing loop (the chooser's probe, the all-reduce calibration, every benchmark): variants
interleaved per round, warm-up rounds dropped, a round as long as its slowest rank.

    samples = interleaved({"stock": lambda: timed(f), "flash": lambda: timed(g)}, rounds=5)
    samples = rank_max(samples)                  # a round lasts as long as its slowest rank
    median = statistics.median(samples["flash"])  # a figure = the median over rounds (the caller's statistic)

    round 0 (warm-up) | stock flash | dropped
    round 1           | stock flash |  rotate=True: round r starts at variant r mod len (flash stock)
    ...
A variant is a callable that runs ONE measured call and returns its seconds: `timed` (host clock, after a
barrier of the default group; `sync` waits for the device), `cuda_timed` (CUDA events), or `pass_seconds`
(one forward, or forward + backward, of a block: fresh leaf input before the clock, grads dropped after).

    paired(candidates, group, device, replicas=None)  {name: [seconds per kept round]}, the max over the group's
                                       ranks (and over `replicas`: a group of every rank whose choice must agree)
        cpu   the host clock around each call, after a barrier of the group (gloo: a post blocks the host,
              so the host clock is the collective's time)
        cuda  a CUDA event pair around each call on the current stream, ONE synchronize after the last round
              (nothing inside a timed region waits for the device: NCCL's calls stay stream-ordered)
"""
from __future__ import annotations

import time
from typing import Callable, Hashable, Mapping

import torch
import torch.distributed as dist


def cuda_timed(fn: Callable[[], object]) -> float:
    """Seconds of one fn() between two CUDA events on the current stream (no barrier; one device)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


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


def rank_max(samples: Mapping[Hashable, list[float]], group=None,
             device: torch.device | None = None) -> dict[Hashable, list[float]]:
    """Per key and round, the max over the ranks of `group` (every rank holds the same keys and rounds);
    `device`: where the reduced tensor lives (a CUDA device for an NCCL group; None: the host)."""
    keys = list(samples)
    if not dist.is_initialized() or not keys:
        return {k: list(samples[k]) for k in keys}
    t = torch.tensor([samples[k] for k in keys], dtype=torch.float64, device=device)  # [keys, rounds]
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return dict(zip(keys, t.tolist()))


def paired(candidates: Mapping[str, Callable[[], object]], group, device: torch.device, *, rounds: int = 5,
           warmup: int = 1, replicas=None) -> dict[str, list[float]]:
    """{name: [seconds of one call per kept round]} of every candidate, `warmup + rounds` rounds, the order
    rotated per round (round r starts at candidate r mod n), then the max over `group` and `replicas` (module
    docstring). Collective: every rank of `group` (and of `replicas`) calls it with the same candidates."""
    names = list(candidates)
    if device.type != "cuda":
        samples = rank_max(interleaved({n: (lambda f=candidates[n]: timed(f, group=group)) for n in names}, rounds,
                                       warmup=warmup, rotate=True), group)
        return samples if replicas is None else rank_max(samples, replicas)
    events: dict[str, list] = {n: [] for n in names}

    def recorded(name):
        def run():
            pair = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            pair[0].record()
            candidates[name]()
            pair[1].record()
            events[name].append(pair)
            return 0.0
        return run
    interleaved({n: recorded(n) for n in names}, rounds, warmup=warmup, rotate=True)
    torch.cuda.synchronize(device)
    kept = {n: [a.elapsed_time(b) / 1e3 for a, b in events[n][warmup:]] for n in names}
    kept = rank_max(kept, group, device)  # NCCL reduces device tensors only
    return kept if replicas is None else rank_max(kept, replicas, device)
