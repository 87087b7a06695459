"""Rank-side timing: block, compute alone, communication alone; interleaved repeats; medians over ranks.

For one (block kind, shape) and every method, each repeat times, in this order:
    block    the block on the real (shaped) group
    compute  the same block on a *fake* process group of the same size: identical GEMM slices, buffers and
             executor walk, but every transfer completes at once without moving data
    comm     the block on the real group with inner width 1: identical transfers, GEMMs shrunk to O(bytes)
A sample is the max over ranks of one call's duration (every rank starts after a barrier); the loop is
runtime/timing.py `interleaved`, every (method, mode, measure) one variant of a round.
"""
from __future__ import annotations

import statistics

import torch
import torch.distributed as dist

from megatron_flashoverlap.runtime import OverlapContext
from benchmarks.harness.blocks import Method, Shape, comm_only, make_block
from benchmarks.harness.estimator import estimate
from megatron_flashoverlap.runtime.timing import interleaved, pass_seconds, rank_max

MODES = ("fwd", "fwd+bwd")
MEASURES = ("block", "compute", "comm")


def fake_group(world: int):
    """A process group of `world` ranks whose collectives and P2P ops move nothing (torch's "fake" backend)."""
    try:
        import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the "fake" backend)
    except ImportError as e:  # pragma: no cover - torch without the testing package
        raise RuntimeError("compute-alone timing needs torch's fake process group "
                           "(torch.testing._internal.distributed.fake_pg)") from e
    return dist.new_group(ranks=list(range(world)), backend="fake")


class Runner:
    """Holds the tensors of one (kind, shape) on this rank and times single calls."""

    def __init__(self, kind: str, shape: Shape, world: int):
        self.full = make_block(kind, shape, world)
        self.thin = make_block(kind, comm_only(shape), world)
        self.x = self.full.input()
        self.dy = torch.randn_like(self.x)
        self.ctx = OverlapContext(check_peers=False)

    def call(self, block, group, method: Method, mode: str, ctx=None, spans=None) -> float:
        """Seconds for one forward (+ backward) of `block`; grads are dropped afterwards."""
        return pass_seconds(lambda x: block.forward(x, group, method, ctx or self.ctx, spans), self.x, mode, self.dy,
                            block.params())

    def variants(self, method: Method, mode: str, real, fake) -> dict:
        """The three measured calls of one (method, mode): {(method, mode, measure): () -> seconds}."""
        calls = {"block": (self.full, real), "compute": (self.full, fake), "comm": (self.thin, real)}
        return {(method.name, mode, k): (lambda b=b, g=g: self.call(b, g, method, mode)) for k, (b, g) in calls.items()}


def measure(runner: Runner, methods, repeats: int, real, fake, tick=None) -> dict:
    """{(method, mode, measure): [seconds, max over ranks, per repeat]}, after one warm-up round."""
    variants = {k: v for m in methods for mode in MODES for k, v in runner.variants(m, mode, real, fake).items()}
    return rank_max(interleaved(variants, repeats, tick=tick))


def combine(samples: dict) -> dict:
    """Rank-max samples per repeat -> {key: {"median", "lo", "hi", "n", "samples"}} (lo/hi: min, max)."""
    return {key: {"median": statistics.median(s), "lo": min(s), "hi": max(s), "n": len(s), "samples": list(s)}
            for key, s in samples.items()}


def derived(stats: dict, method: str, mode: str) -> dict:
    """The row of one (method, mode): harness/estimator.estimate over the rounds (block = median(block),
    exposed = median(block) - median(compute), hidden = 1 - exposed / median(comm), bound, their 90 %
    bootstrap intervals), the block's spread (min, max) and its per-round samples (for speedup intervals)."""
    b, c, m = (stats[(method, mode, k)]["samples"] for k in MEASURES)
    return {**estimate(b, c, m), "spread": (min(b), max(b)), "samples": list(b)}
