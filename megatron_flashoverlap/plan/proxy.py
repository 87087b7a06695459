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
                    reduce_scatter = the benchmarks' line-rate ring: (P - 1) of our hops of one chunk
                    all_reduce (n) = allreduce(n)
    proxy_gpu(add_fit)          a Gpu whose elementwise kernels cost the measured add (kernel_us = alpha,
                                hbm = 3 * 4 bytes per element / per_byte); its GEMMs come from gemm.TableGemm
Pure: no torch. The fits carry no GPU meaning; they price the proxy only.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from .hardware import Cluster, Gpu
from .links import Group, Net


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

    def collective(self, kind: str, total: float, group: Group) -> float:
        p = group.size
        if p == 1 or total <= 0:
            return 0.0
        if kind == "reduce_scatter":
            return (p - 1) * self.hop(total / p, total / p, group.spans, self.ring_senders(group))
        if kind in ("all_gather", "all_to_all"):
            return self.fits["allgather"](total / p)
        if kind == "all_reduce":
            return self.fits["allreduce"](total)
        raise ValueError(f"unknown collective {kind!r}")


def proxy_gpu(add: Fit, name: str = "cpu-proxy") -> Gpu:
    """A Gpu whose elementwise kernels cost the measured fp32 add (module docstring); its GEMM rates are
    placeholders: a TableGemm prices every GEMM from measurements."""
    per_element = max(add.per_byte, 1e-15)  # add.per_byte: seconds per element of the add
    return Gpu(name, {"fp32": 1.0, "bf16": 1.0, "fp16": 1.0}, hbm_gbps=12.0 / per_element / 1e9, sms=1,
               gemm_efficiency=1.0, kernel_us=add.alpha * 1e6, hbm_efficiency=1.0)


__all__ = ["Fit", "ProxyNet", "fit", "proxy_gpu"]
