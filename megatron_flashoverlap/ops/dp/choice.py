"""Which weights to fuse: a cost model of Megatron's `--overlap-grad-reduce` backward (pure: no torch).

    Param(numel, linear)            one trainable parameter, in backward (= layout) order
    Rates(comm_s, ring_s, gemm_s, ring_lat_s, hops)   seconds per gradient element of stock's DP reduce-
                                    scatter (comm_s) and of our ring (ring_s, ops/dp/wgrad_rs.py); seconds per
                                    weight element of ONE GEMM of the layer's backward (dgrad and wgrad each
                                    cost it); seconds of a ring call over (almost) nothing (its per-call
                                    latency); the ring's hops (DP size - 1)
    simulate(params, fused, bucket_size, rates, asynchronous=False) -> Outcome(compute, exposed, step)
    choose(params, bucket_size, rates, asynchronous=False) -> (k, Outcome of k, Outcome of stock): fuse the k
                                    candidate linears reduced LAST in backward (the first layers), k
                                    minimizing the modelled step
    worker_pays(params, bucket_size, rates) -> bool: the best choice on the DP worker models a step shorter
                                    than the best with rings in backward (they would stall it: a ring longer
                                    than the wgrad GEMM it hides under) by more than one call latency per
                                    fused ring; ties go to the backward (the worker's host time is unmodelled)

The model (one serial link, one compute thread; the backward is the linears' dgrad + wgrad GEMMs):

    compute  | p1 dgrad wgrad | p2 ... | fused w: dgrad, wgrad half | own half | v: dgrad, (wait w) ... |
    link     |     bucket 1 RS (starts when its last param is ready) | bucket 2 RS | w's ring ...| v's ring
                                                                                          exposed = tail

A stock bucket's reduce-scatter starts when its last parameter's gradient is ready and the link is free
(Megatron's buckets go one at a time: one communication handle outstanding, and one link). A fused weight's
ring starts at its wgrad (when the link is free); the compute thread waits for its first hops - 1 of `hops`
hops in its wgrad (hops > 1: each one's partial is added and forwarded), and for its last hop when the next
fused weight's wgrad begins (after that weight's dgrad) or, for the last ring, at the end (the deferred last
hop, megatron/ddp/grad_sync.py). `asynchronous` (the ring on the DP worker
thread, megatron/ddp/worker.py): the compute thread does not wait; the ring occupies the link from its
wgrad on, like a bucket of its own reduced by our ring (its GEMM slices still cost their time). The non-fused parameters are re-bucketed by
Megatron's size rule, as `megatron/ddp/layout.isolated_buckets` lays them out. Non-linear parameters (norms, biases,
embeddings) cost no compute here (their backward is small next to the GEMMs; attention's score GEMMs are
left out too, so the model under-counts compute and errs towards fusing more).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Param:
    numel: int
    linear: bool  # a candidate for the fused reduce-scatter (a TP linear's weight)


@dataclass(frozen=True)
class Rates:
    comm_s: float  # seconds per gradient element reduce-scattered over DP by stock's collective
    ring_s: float  # the same by our ring (the fused weights' reduce-scatter)
    gemm_s: float  # seconds per weight element of one backward GEMM (dgrad or wgrad) at this token count
    ring_lat_s: float = 0.0  # seconds of one ring call whatever its size (hops, host work)
    hops: int = 1  # hops of the ring: DP size - 1

    def __post_init__(self):
        if self.hops < 1:
            raise ValueError(f"Rates: hops={self.hops}; a ring over D ranks has D - 1 >= 1 hops")
        if not min(self.comm_s, self.ring_s, self.gemm_s, self.ring_lat_s) >= 0:
            raise ValueError(f"Rates: comm_s={self.comm_s}, ring_s={self.ring_s}, gemm_s={self.gemm_s}; each must "
                             f"be >= 0 seconds per element (measure them with megatron/ddp/choice.calibrate)")


@dataclass(frozen=True)
class Outcome:
    compute: float  # end of the backward's compute (fused rings' waits included)
    exposed: float  # DP communication still running after it
    step: float  # compute + exposed: the backward + grad sync the model predicts


def _buckets(params, fused: set, bucket_size) -> list[list[int]]:
    """Megatron's size rule over the non-fused params (backward order) -> lists of indices."""
    out, filled = [[]], 0
    for i, p in enumerate(params):
        if i in fused:
            continue
        if bucket_size is not None and filled >= bucket_size and out[-1]:
            out.append([])
            filled = 0
        out[-1].append(i)
        filled += p.numel
    return [b for b in out if b]


def simulate(params: list[Param], fused: set, bucket_size: int | None, rates: Rates,
             asynchronous: bool = False) -> Outcome:
    """The modelled backward (module docstring) with the params at indices `fused` fused."""
    last_of = {b[-1]: sum(params[i].numel for i in b) for b in _buckets(params, fused, bucket_size)}
    t = link = pending = 0.0
    for i, p in enumerate(params):
        gemm = rates.gemm_s * p.numel if p.linear else 0.0
        if i in fused:
            t += gemm  # dgrad
            t = t if asynchronous else max(t, pending)  # the previous ring's last hop
            start = max(t, link)
            ring = rates.ring_s * p.numel
            link = pending = start + rates.ring_lat_s + ring
            t += gemm  # wgrad; in backward it waits on the hops before the last (none when hops = 1)
            if not asynchronous and rates.hops > 1:
                t = max(t, start + rates.ring_lat_s + ring * (rates.hops - 1) / rates.hops)
        else:
            t += 2 * gemm
        if i in last_of:
            link = max(t, link) + rates.comm_s * last_of[i]
    exposed = max(0.0, link - t)
    return Outcome(t, exposed, t + exposed)


def tail_candidates(params: list[Param]) -> list[int]:
    """Indices of the linear params, the one reduced last in backward first."""
    return [i for i in range(len(params) - 1, -1, -1) if params[i].linear]


def worker_pays(params: list[Param], bucket_size: int | None, rates: Rates) -> bool:
    """Whether the rings should run on the DP worker (module docstring): its best modelled step must beat the
    best in backward by more than one more call latency per fused ring (the hand-off to the worker thread;
    its other host time is not modelled)."""
    k, worker, _ = choose(params, bucket_size, rates, True)
    return worker.step + k * rates.ring_lat_s < choose(params, bucket_size, rates, False)[1].step * (1 - 1e-9)


def choose(params: list[Param], bucket_size: int | None, rates: Rates,
           asynchronous: bool = False) -> tuple[int, Outcome, Outcome]:
    """(k, its outcome, stock's outcome): fusing the last k candidates in backward order minimizes the
    modelled step (ties: the smaller k, the fewer changes to Megatron's buckets)."""
    tail = tail_candidates(params)
    stock = simulate(params, set(), bucket_size, rates)
    best_k, best = 0, stock
    for k in range(1, len(tail) + 1):
        out = simulate(params, set(tail[:k]), bucket_size, rates, asynchronous)
        if out.step < best.step * (1 - 1e-9):
            best_k, best = k, out
    return best_k, best, stock
