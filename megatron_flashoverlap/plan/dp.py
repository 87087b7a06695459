"""The data-parallel gradient reduce-scatter of one backward: stock buckets, or rings fused into the wgrad GEMMs.

The one DP cost model: the planner prices it from its figures (`sync`), pretrain()'s automatic choice from
rates measured on the real DP group (`Rates`, megatron/ddp/auto_fuse.py). Pure: no torch.

    Grad(name, numel, before, wgrad, ring)   one trainable parameter in backward (= Megatron's layout) order:
                                    `before` seconds of its backward before the wgrad GEMM (the dgrad; all of a
                                    parameter that is no GEMM's weight), `wgrad` seconds of that GEMM, `ring`
                                    seconds of our DP ring reducing its gradient (None: not a candidate)
    Link(comm, hops)                comm(n): seconds of stock's reduce-scatter of a bucket of n gradient elements;
                                    hops: the ring's, DP size - 1
    simulate(grads, fused, bucket_size, link, asynchronous) -> Outcome(compute, exposed, step)
    choose(grads, bucket_size, link, asynchronous) -> (k, Outcome of k, Outcome of stock): fuse the k
                                    candidates reduced LAST in backward (the first layers), k minimizing the step
    worker_pays(grads, bucket_size, link) -> bool   the rings on the DP worker thread (module note below)
    sync(env, g, grads, fused) -> DpTimes           the planner's view: every candidate fused, or none

One serial link, one compute thread:

    compute  | p1 dgrad wgrad | p2 ... | fused w: dgrad, wgrad (waits hops-1 of its hops) | v: dgrad, (wait w) ...
    link     |     bucket 1 RS (starts when its last param is ready) | bucket 2 RS | w's ring ...| v's ring
                                                                                          exposed = tail

A stock bucket (Megatron's size rule over the parameters not fused, megatron/ddp/layout.isolated_buckets)
reduce-scatters when its last gradient is ready and the link is free: Megatron's buckets go one at a time. A
fused weight's ring starts at its wgrad when the link is free; the compute thread waits for its first hops - 1
of `hops` hops in the wgrad (each partial is added and forwarded), and for its last hop when the next fused
weight's wgrad begins, or at the end (the deferred last hop, megatron/ddp/grad_sync.py). `asynchronous` (the
rings on the DP worker thread, megatron/ddp/worker.py): the compute thread never waits; a ring holds the link
from its wgrad on, like a bucket of its own. The worker pays only where its best step beats the best in
backward by more than one call latency per fused ring (the hand-off; its other host time is not modelled).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from .links import Group
from .price import ACC_BYTES, Env

BUCKET_MIN, BUCKET_PER_RANK = 40_000_000, 1_000_000  # Megatron DDP's default bucket size: max(40M, 1M x dp)


@dataclass(frozen=True)
class Grad:
    name: str
    numel: int
    before: float
    wgrad: float = 0.0
    ring: float | None = None


@dataclass(frozen=True)
class Link:
    comm: Callable[[int], float]
    hops: int = 1

    def __post_init__(self):
        if self.hops < 1:
            raise ValueError(f"Link: hops={self.hops}; a ring over D ranks has D - 1 >= 1 hops")


@dataclass(frozen=True)
class Outcome:
    compute: float  # end of the backward's compute (fused rings' waits included)
    exposed: float  # DP communication still running after it
    step: float  # compute + exposed: the backward + grad sync the model predicts


def megatron_bucket_size(dp: int) -> int:
    """Megatron DDP's default bucket size (distributed_data_parallel.py)."""
    return max(BUCKET_MIN, BUCKET_PER_RANK * dp)


def _buckets(grads: Sequence[Grad], fused: set, bucket_size: int | None) -> list[list[int]]:
    """Megatron's size rule over the non-fused grads (backward order) -> lists of indices."""
    out, filled = [[]], 0
    for i, p in enumerate(grads):
        if i in fused:
            continue
        if bucket_size is not None and filled >= bucket_size and out[-1]:
            out.append([])
            filled = 0
        out[-1].append(i)
        filled += p.numel
    return [b for b in out if b]


def simulate(grads: Sequence[Grad], fused: set, bucket_size: int | None, link: Link,
             asynchronous: bool = False) -> Outcome:
    """The modelled backward (module docstring) with the grads at indices `fused` fused."""
    last_of = {b[-1]: sum(grads[i].numel for i in b) for b in _buckets(grads, fused, bucket_size)}
    t = free = pending = 0.0
    for i, p in enumerate(grads):
        t += p.before
        if i in fused:
            t = t if asynchronous else max(t, pending)  # the previous ring's last hop
            start = max(t, free)
            free = pending = start + p.ring
            t += p.wgrad
            if not asynchronous and link.hops > 1:  # the hops before the last, waited in the wgrad
                t = max(t, start + p.ring * (link.hops - 1) / link.hops)
        else:
            t += p.wgrad
        if i in last_of:
            free = max(t, free) + link.comm(last_of[i])
    exposed = max(0.0, free - t)
    return Outcome(t, exposed, t + exposed)


def tail_candidates(grads: Sequence[Grad]) -> list[int]:
    """Indices of the fusable grads, the one reduced last in backward first."""
    return [i for i in range(len(grads) - 1, -1, -1) if grads[i].ring is not None]


def choose(grads: Sequence[Grad], bucket_size: int | None, link: Link,
           asynchronous: bool = False) -> tuple[int, Outcome, Outcome]:
    """(k, its outcome, stock's outcome): fusing the last k candidates in backward order minimizes the
    modelled step (ties: the smaller k, the fewer changes to Megatron's buckets)."""
    tail = tail_candidates(grads)
    stock = simulate(grads, set(), bucket_size, link)
    best_k, best = 0, stock
    for k in range(1, len(tail) + 1):
        out = simulate(grads, set(tail[:k]), bucket_size, link, asynchronous)
        if out.step < best.step * (1 - 1e-9):
            best_k, best = k, out
    return best_k, best, stock


def worker_pays(grads: Sequence[Grad], bucket_size: int | None, link: Link, call_s: float) -> bool:
    """Whether the rings should run on the DP worker (module docstring); `call_s`: one ring call's latency."""
    k, worker, _ = choose(grads, bucket_size, link, True)
    return worker.step + k * call_s < choose(grads, bucket_size, link, False)[1].step * (1 - 1e-9)


@dataclass(frozen=True)
class Rates:
    """Seconds per gradient element measured on the DP group (megatron/ddp/auto_fuse.calibrate): stock's
    reduce-scatter (comm_s), our ring (ring_s) and one backward GEMM, dgrad or wgrad (gemm_s, at the run's
    token count); a ring call over (almost) nothing (ring_lat_s); the ring's hops (DP size - 1)."""

    comm_s: float
    ring_s: float
    gemm_s: float
    ring_lat_s: float = 0.0
    hops: int = 1

    def __post_init__(self):
        if not min(self.comm_s, self.ring_s, self.gemm_s, self.ring_lat_s) >= 0:
            raise ValueError(f"Rates: comm_s={self.comm_s}, ring_s={self.ring_s}, gemm_s={self.gemm_s}; each must "
                             f"be >= 0 seconds per element (measure them with megatron/ddp/auto_fuse.calibrate)")
        Link(self.comm, self.hops)  # the same check of hops

    def comm(self, n: int) -> float:
        return self.comm_s * n

    def link(self) -> Link:
        return Link(self.comm, self.hops)

    def grads(self, params: Sequence[tuple[int, bool]]) -> list[Grad]:
        """(numel, is a TP linear's weight) in backward order -> Grads: a linear's backward is its dgrad and
        wgrad GEMMs; other parameters cost no compute (norms, biases, embeddings are small next to the GEMMs;
        attention's score GEMMs are left out too, so the model under-counts compute and errs towards fusing)."""
        return [Grad(str(i), n, self.gemm_s * n, self.gemm_s * n, self.ring_lat_s + self.ring_s * n)
                if linear else Grad(str(i), n, 0.0) for i, (n, linear) in enumerate(params)]


@dataclass(frozen=True)
class DpTimes:
    exposed: float
    extra: float  # backward time added over the parameters' own compute (waits on rings)


def sync(env: Env, g: Group, grads: Sequence[Grad], fused: bool) -> DpTimes:
    """The planner's DP reduce-scatter of one backward: every candidate fused (`fused`), or Megatron's buckets."""
    if g.size == 1:
        return DpTimes(0.0, 0.0)
    link = Link(lambda n: env.net.collective("reduce_scatter", n * ACC_BYTES, g), g.size - 1)
    out = simulate(grads, set(tail_candidates(grads)) if fused else set(), megatron_bucket_size(g.size), link)
    return DpTimes(out.exposed, out.compute - sum(p.before + p.wgrad for p in grads))
