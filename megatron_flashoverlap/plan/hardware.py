"""What the planner prices on: a GPU, its links, a cluster (dataclasses; the numbers live in catalog.py).

    Gpu       peak dense matrix TFLOP/s per dtype, HBM GB/s, SM count, the fraction of peak a large GEMM reaches
    Link      one level of the network: GB/s per direction per GPU (NVLink) or per NIC (IB), the fraction NCCL's
              collectives reach (busbw / raw), the fraction one point-to-point flow reaches, latencies (NCCL's
              per-step terms, and our executor's per-hop cost: one send/recv post and its wait)
    Cluster   gpu, intra-node link, inter-node link, GPUs per node, nodes, NICs per node, the compute slowdown
              while a transfer runs beside a GEMM (SM / memory contention)

A user's own hardware: a JSON file (`load_hardware`) with {"gpus": {name: {...Gpu fields}}, "links": {name:
{...Link fields}}}, merged over the catalogue (the start-up probe writes the same form: plan/probe_plan.hardware_json).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Mapping

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp8": 1, "fp32": 4, "tf32": 4}


@dataclass(frozen=True)
class Gpu:
    """One GPU type. peak_tflops: dense matrix rate per dtype (no sparsity); gemm_efficiency: the fraction of it a
    large well-shaped GEMM reaches (cuBLAS); kernel_us: the fixed cost of one GEMM (or add) kernel."""

    name: str
    peak_tflops: Mapping[str, float]
    hbm_gbps: float
    sms: int
    gemm_efficiency: float
    kernel_us: float = 3.0
    hbm_efficiency: float = 0.9

    def __post_init__(self):
        if not self.peak_tflops or min(self.peak_tflops.values()) <= 0 or self.hbm_gbps <= 0 or self.sms < 1:
            raise ValueError(f"gpu {self.name!r}: peak_tflops, hbm_gbps and sms must be > 0")
        if not 0 < self.gemm_efficiency <= 1 or not 0 < self.hbm_efficiency <= 1:
            raise ValueError(f"gpu {self.name!r}: gemm_efficiency and hbm_efficiency are fractions in (0, 1]")

    def peak(self, dtype: str) -> float:
        """FLOP/s of the matrix units in `dtype`."""
        if dtype not in self.peak_tflops:
            raise ValueError(f"gpu {self.name!r} has no {dtype} rate; it has {sorted(self.peak_tflops)}")
        return self.peak_tflops[dtype] * 1e12


@dataclass(frozen=True)
class Link:
    """One network level. gbps: GB/s per direction, per GPU (NVLink, PCIe) or per NIC (IB, RoCE, Slingshot).
    nccl_lat_us: NCCL's latency terms (LL, LL128, Simple): `base` once per collective, `hop` per ring step.
    p2p_us: one hop of our executor (a send/recv post and its wait, whatever its size).
    call_us: what one torch.distributed collective call costs beyond NCCL's kernel model (the launch and the
    stream handoff around it). ll_max_gbps: NCCL's cap on the LL protocol's bus bandwidth inside one node (0:
    none). nvls_efficiency: NVLink SHARP's all-reduce busbw / gbps on large messages (0: no NVLS);
    nvls_mid_efficiency: the same over a message's first NVLS_RAMP_BYTES (links.py). post_us: the part of p2p_us
    that is the posting thread's own work, free to run while the previous hop's bytes are in flight (None:
    call_us, a torch call's host cost; the rest of p2p_us runs in the stream, after the previous hop)."""

    name: str
    gbps: float
    coll_efficiency: float
    p2p_efficiency: float
    base_lat_us: tuple[float, float, float]
    hop_lat_us: tuple[float, float, float]
    p2p_us: float
    nvls_efficiency: float = 0.0
    nvls_mid_efficiency: float = 0.0
    call_us: float = 0.0
    ll_max_gbps: float = 0.0
    post_us: float | None = None

    def __post_init__(self):
        if self.gbps <= 0 or not 0 < self.coll_efficiency <= 1.2 or not 0 < self.p2p_efficiency <= 1:
            raise ValueError(f"link {self.name!r}: gbps > 0 and efficiencies in (0, 1] are required")


@dataclass(frozen=True)
class Cluster:
    """gpus_per_node GPUs per node, `nodes` nodes; `slowdown`: a GEMM slice runs (1 + slowdown) times longer
    while one of our transfers is in flight beside it (NCCL's kernels take SMs and memory bandwidth)."""

    gpu: Gpu
    intra: Link
    inter: Link
    gpus_per_node: int = 8
    nodes: int = 1
    nics_per_node: int = 8
    slowdown: float = 0.10

    def __post_init__(self):
        if self.gpus_per_node < 1 or self.nodes < 1 or self.nics_per_node < 1:
            raise ValueError("gpus_per_node, nodes and nics_per_node must be >= 1")
        if not 0 <= self.slowdown < 2:
            raise ValueError(f"slowdown {self.slowdown} must be in [0, 2): the fraction a GEMM slows while a "
                             f"transfer runs")

    @property
    def world(self) -> int:
        return self.gpus_per_node * self.nodes

    def link(self, inter: bool) -> Link:
        return self.inter if inter else self.intra


def _build(kind, name: str, values: Mapping):
    known = {f.name for f in fields(kind)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"{kind.__name__.lower()} {name!r}: unknown field(s) {unknown}; valid: {sorted(known)}")
    kw = {k: (tuple(v) if isinstance(v, list) else v) for k, v in values.items()}
    return kind(**{"name": name, **kw})


def load_hardware(path: str | Path, gpus: dict, links: dict) -> tuple[dict, dict]:
    """The catalogue with the JSON file's entries added or replacing (module docstring)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"hardware file {str(path)!r} does not exist")
    data = json.loads(path.read_text())
    if not isinstance(data, dict) or set(data) - {"gpus", "links"}:
        raise ValueError(f"{path}: expected {{'gpus': {{...}}, 'links': {{...}}}}")
    gpus = {**gpus, **{n: _build(Gpu, n, v) for n, v in data.get("gpus", {}).items()}}
    links = {**links, **{n: _build(Link, n, v) for n, v in data.get("links", {}).items()}}
    return gpus, links


__all__ = ["Cluster", "DTYPE_BYTES", "Gpu", "Link", "load_hardware"]
