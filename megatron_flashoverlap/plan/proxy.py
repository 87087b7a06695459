"""The CPU proxy as a priced machine: gloo ranks over a tbf- or htb-shaped loopback, calibrated by measurement
(benchmarks/planner/calibrate.py), not by a catalogue.

    Fit(alpha, per_byte)        t = alpha + per_byte * bytes, fitted to measured (bytes, seconds) (`fit`)
    ProxyNet(cluster, fits, shared)   every fit measured on a group of the size it prices (no extrapolation
                                      in P: the per-step host cost grows with processes per core)
        hop         one post of our executor: shared (one tbf on lo, every flow of every rank in it): the
                    "hop" fit (a Flash-AG walk's time / (P - 1)); two-level (htb per node, shared False):
                    Net.hop on the cluster's calibrated links
        collective  gloo's own, from their fits:  all_gather (total) = allgather(total / P)
                    all_to_all (buffer) = allgather(buffer / P)   (the same bytes leave each rank)
                    reduce_scatter = the "reducescatter" fit (per-rank bytes out) where the probe timed
                    stock's own call; else the benchmarks' line-rate ring as (P - 1) of our hops of one chunk
                    all_reduce (n) = allreduce(n)
        collective_fixed   a call's host part, its fit's alpha (reduce_scatter: one hop's): on the CPU it
                    runs on gloo's worker, on the core the rank computes on (host_is_compute), so the walk
                    shares the core between it and the compute beside it (walk.py `worker` units), while the
                    previous call's bytes may still be on the link; our hops' host parts are the posting
                    thread's, charged to the compute stream
    proxy_gpu(add_fit, element_bytes)   a Gpu whose elementwise kernels cost the measured add (kernel_us =
                                alpha, hbm = 3 * element bytes / per_byte); its GEMMs come from gemm.TableGemm
    link_fit(points)            a shaped link's hop from the probe's sizes: the sustained rate of the two largest,
                                the fixed cost of the smallest (tbf / htb pass a burst at memory speed after idle)
    link_of(name, fit, flows)   a Link whose hop is the fit: p2p_us = alpha, rate = flows / per_byte (the fit
                                measured `flows` flows sharing the link at once)
    probed_env(figures, add_fit, slowdown, element_bytes)   the proxy priced from the chooser's start-up probe
                                (megatron/probe.py `measure` with stock_bytes: GEMM table, hops, stock's
                                collectives), measured on the group it prices:
        one node     every rank on one shaped queue: ProxyNet(shared), hop = the fit of the probe's "intra"
                     exchanges (every rank exchanging at once, as a ring step)
        two levels   ProxyNet(shared=False): Net.hop on an intra link fitted to "intra" and an inter link
                     fitted to "inter" (every local rank crossing at once: the node's rate = G flows' worth)
        stock        all_gather / all_to_all / all_reduce / reduce_scatter from the probe's "stock" rows (a
                     probe without reduce-scatter rows: the line-rate ring of our hops, the benchmarks' stock)
Pure: no torch. The fits carry no GPU meaning; they price the proxy only.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from .gemm import TableGemm
from .hardware import Cluster, Gpu, Link
from .links import Group, Net
from .price import Env


@dataclass(frozen=True)
class Fit:
    alpha: float
    per_byte: float

    def __call__(self, nbytes: float) -> float:
        return self.alpha + self.per_byte * nbytes


def fit(points: Sequence[tuple[float, float]]) -> Fit:
    """Line through (bytes, seconds) minimising the squared RELATIVE error (weights 1 / seconds^2: the small
    sizes fix alpha, the large ones the slope); alpha and slope clamped at >= 0."""
    pts = [(float(x), float(y)) for x, y in points if y > 0]
    if len(pts) < 2:
        raise ValueError("fit needs at least two (bytes, seconds > 0) points")
    w = [1.0 / y ** 2 for _, y in pts]
    sw = sum(w)
    mx = sum(wi * x for wi, (x, _) in zip(w, pts)) / sw
    my = sum(wi * y for wi, (_, y) in zip(w, pts)) / sw
    sxx = sum(wi * (x - mx) ** 2 for wi, (x, _) in zip(w, pts))
    slope = max(0.0, sum(wi * (x - mx) * (y - my) for wi, (x, y) in zip(w, pts)) / sxx) if sxx > 0 else 0.0
    return Fit(max(0.0, my - slope * mx), slope)


def link_fit(points: Sequence[tuple[float, float]]) -> Fit:
    """A shaped link's line from a probe's (bytes, seconds), at least three sizes: per_byte = the marginal cost
    between the two largest sizes (the sustained rate), alpha = the least time among the smaller sizes (the fixed
    cost of one call). Not a line through every size: tbf and htb pass a bucket of `burst` bytes at memory speed
    after idle, so an isolated small exchange shows no rate at all, while a walk's back-to-back hops drain the
    bucket and pay the rate; the least of the small times is the one a load spike did not inflate."""
    pts = sorted((float(x), float(y)) for x, y in points if y > 0)
    if len(pts) < 3:
        raise ValueError("link_fit needs at least three (bytes, seconds > 0) points")
    (x1, y1), (x2, y2) = pts[-2:]
    return Fit(min(y for _, y in pts[:-2]), max(0.0, (y2 - y1) / (x2 - x1)))


class ProxyNet(Net):
    """Hops and gloo collectives on the shaped loopback (module docstring). fits: "hop" (one hop of our
    executor), "allgather" (per-rank bytes), "allreduce" (bytes), each measured on a group of this size."""

    def __init__(self, cluster: Cluster, fits: Mapping[str, Fit], shared: bool = True):
        super().__init__(cluster)
        missing = {"hop", "allgather", "allreduce"} - set(fits)
        if missing:
            raise ValueError(f"ProxyNet needs fits {sorted(missing)}; calibrate them first")
        self.fits, self.shared = dict(fits), shared

    def hop(self, sent: float, received: float, inter: bool, senders: int = 1) -> float:
        if not self.shared:
            return super().hop(sent, received, inter, senders)
        return self.fits["hop"](max(sent, received))

    host_is_compute = True  # one core per gloo rank: a hop's post blocks compute, a collective's worker shares it

    def hop_fixed(self, inter: bool) -> float:
        return self.fits["hop"].alpha if self.shared else super().hop_fixed(inter)

    def collective_fixed(self, kind: str, group: Group) -> float:
        """The least time of one gloo call (its fit's alpha): the host work of the post (module docstring)."""
        if group.size == 1:
            return 0.0
        if kind == "reduce_scatter":
            return self.fits["reducescatter"].alpha if "reducescatter" in self.fits else self.hop_fixed(group.spans)
        if kind in ("all_gather", "all_to_all"):
            return self.fits["allgather"].alpha
        if kind == "all_reduce":
            return self.fits["allreduce"].alpha
        raise ValueError(f"unknown collective {kind!r}")

    def collective(self, kind: str, total: float, group: Group) -> float:
        p = group.size
        if p == 1 or total <= 0:
            return 0.0
        if kind == "reduce_scatter":
            if "reducescatter" in self.fits:
                return self.fits["reducescatter"](total / p)
            return (p - 1) * self.hop(total / p, total / p, group.spans, self.ring_senders(group))
        if kind in ("all_gather", "all_to_all"):
            return self.fits["allgather"](total / p)
        if kind == "all_reduce":
            return self.fits["allreduce"](total)
        raise ValueError(f"unknown collective {kind!r}")


def proxy_gpu(add: Fit, name: str = "cpu-proxy", element_bytes: int = 4) -> Gpu:
    """A Gpu whose elementwise kernels cost the measured add of `element_bytes` elements (module docstring);
    its GEMM rates are placeholders: a TableGemm prices every GEMM from measurements."""
    per_element = max(add.per_byte, 1e-15)  # add.per_byte: seconds per element of the add
    return Gpu(name, {"fp32": 1.0, "bf16": 1.0, "fp16": 1.0}, hbm_gbps=3.0 * element_bytes / per_element / 1e9,
               sms=1, gemm_efficiency=1.0, kernel_us=add.alpha * 1e6, hbm_efficiency=1.0)


def link_of(name: str, f: Fit, flows: int = 1) -> Link:
    """A Link whose one hop costs f (module docstring)."""
    gbps = flows / max(f.per_byte, 1e-15) / 1e9
    us = f.alpha * 1e6
    return Link(name, gbps, 1.0, 1.0, (us, us, us), (0.0, 0.0, 0.0), us, post_us=us)


def _rows_fit(rows) -> Fit:
    return link_fit([(b, s) for b, s in rows])


def probed_env(figures: dict, add: Fit, slowdown: float = 0.0, element_bytes: int = 4) -> Env:
    """The proxy from the probe's figures (module docstring); dtype: the probe's ("fp32" on gloo) unless the
    elements priced are 2 bytes ("bf16")."""
    if "stock" not in figures:
        raise ValueError("probed_env needs the probe's stock collectives: measure(..., stock_bytes=sizes)")
    g, nodes = int(figures["gpus_per_node"]), int(figures["nodes"])
    gpu = proxy_gpu(add, element_bytes=element_bytes)
    intra = _rows_fit(figures["intra"])
    fits = {"allgather": _rows_fit(figures["stock"]["all_gather"]),
            "allreduce": _rows_fit(figures["stock"]["all_reduce"])}
    if len(figures["stock"].get("reduce_scatter", ())) >= 3:  # probes before it timed none: the hop ring
        fits["reducescatter"] = _rows_fit(figures["stock"]["reduce_scatter"])
    if nodes == 1:
        link = link_of("probed", intra)
        cluster = Cluster(gpu, link, link, g, 1, 1, slowdown)
        net = ProxyNet(cluster, {"hop": intra, **fits})
    else:
        inter = _rows_fit(figures["inter"])
        cluster = Cluster(gpu, link_of("probed-intra", intra), link_of("probed-inter", inter, g), g, nodes, 1,
                          slowdown)
        net = ProxyNet(cluster, {"hop": inter, **fits}, shared=False)
    dtype = "bf16" if element_bytes == 2 else "fp32"
    rows = {(int(m), int(k), int(n)): float(s) for m, k, n, s in figures["gemm"]}
    return Env(cluster, dtype, TableGemm(gpu, dtype, rows) if rows else None, net)


__all__ = ["Fit", "ProxyNet", "fit", "link_fit", "link_of", "probed_env", "proxy_gpu"]
