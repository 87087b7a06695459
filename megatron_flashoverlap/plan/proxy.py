"""The CPU proxy as a priced machine: gloo ranks over a tbf- or htb-shaped loopback, calibrated by measurement
(benchmarks/planner/calibrate.py), not by a catalogue.

    Fit(alpha, per_byte)        t = alpha + per_byte * bytes, fitted to measured (bytes, seconds) (`fit`)
    ProxyNet(cluster, fits, shared_flows)
        hop         one post of our executor: shared queue (one tbf on lo, every flow of every rank in it):
                        alpha_hop + max(sent, received) * per_byte_hop * flows / 2
                    (the fit is measured at P = 2, two flows; `shared_flows` flows run in a step of P ranks);
                    two-level (htb per node, `shared_flows` None): Net.hop on the cluster's calibrated links
        collective  gloo's own algorithms, from their P = 2 fits (a step = one alpha; bytes as a ring moves them)
                    all_gather / all_to_all   (P - 1) * (alpha_ag + per_byte_ag * chunk * P / 2)
                    reduce_scatter            the benchmarks' line-rate ring = (P - 1) of our hops of one chunk
                    all_reduce (gloo ring)    2 (P - 1) steps of an n/P chunk, P flows: n bytes through the shared
                                              queue per step: (P - 1) * (alpha_ar + per_byte_ar * n); two-level:
                                              2 (P - 1) * (alpha_ar / 2 + chunk / inter rate), the slowest edge
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
    """Hops and gloo collectives on the shaped loopback (module docstring). fits: "hop", "allgather",
    "allreduce" (each a Fit measured at P = 2)."""

    def __init__(self, cluster: Cluster, fits: Mapping[str, Fit], shared_flows: int | None = None):
        super().__init__(cluster)
        missing = {"hop", "allgather", "allreduce"} - set(fits)
        if missing:
            raise ValueError(f"ProxyNet needs fits {sorted(missing)}; calibrate them first")
        self.fits, self.flows = dict(fits), shared_flows

    def hop(self, sent: float, received: float, inter: bool, senders: int = 1) -> float:
        if self.flows is None:
            return super().hop(sent, received, inter, senders)
        f = self.fits["hop"]
        return f.alpha + f.per_byte * max(sent, received) * self.flows / 2

    def collective(self, kind: str, total: float, group: Group) -> float:
        p = group.size
        if p == 1 or total <= 0:
            return 0.0
        if kind == "reduce_scatter":
            return (p - 1) * self.hop(total / p, total / p, group.spans, self.ring_senders(group))
        if kind in ("all_gather", "all_to_all"):
            f = self.fits["allgather"]
            return (p - 1) * (f.alpha + f.per_byte * total / p * (self.flows or p) / 2)
        if kind == "all_reduce":
            f = self.fits["allreduce"]
            if self.flows is not None:
                return (p - 1) * (f.alpha + f.per_byte * total)
            inter = self.cluster.inter
            return 2 * (p - 1) * (f.alpha / 2 + total / p / (inter.gbps * 1e9 * inter.p2p_efficiency))
        raise ValueError(f"unknown collective {kind!r}")


def proxy_gpu(add: Fit, name: str = "cpu-proxy") -> Gpu:
    """A Gpu whose elementwise kernels cost the measured fp32 add (module docstring); its GEMM rates are
    placeholders: a TableGemm prices every GEMM from measurements."""
    per_element = max(add.per_byte, 1e-15)  # add.per_byte: seconds per element of the add
    return Gpu(name, {"fp32": 1.0, "bf16": 1.0, "fp16": 1.0}, hbm_gbps=12.0 / per_element / 1e9, sms=1,
               gemm_efficiency=1.0, kernel_us=add.alpha * 1e6, hbm_efficiency=1.0)


__all__ = ["Fit", "ProxyNet", "fit", "proxy_gpu"]
