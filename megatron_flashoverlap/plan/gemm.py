"""GEMM time by shape: a roofline with wave quantisation (or a measured table).

    y[m, n] = x[m, k] @ w[k, n]     flops 2mkn, bytes (mk + kn + mn) * dtype bytes

    time = kernel + max(flops / (peak * efficiency * tiles(m, n) * depth(k)), bytes / (HBM * hbm_efficiency))

tiles(m, n): the GEMM is cut in output tiles run SMs at a time (waves); the last wave and the edge tiles run
part-empty. The kernel library picks the tile shape that wastes least; smaller tiles cost some throughput
(`TILES`: shape and relative rate [est]). depth(k) = k / (k + K0): the K loop's fill and drain [est].
This is what makes a GEMM cut in P row slices slower than the whole one: each slice fills fewer waves.

`TableGemm` prices from measured times instead (megatron/probe.py, benchmarks/planner): the nearest measured shape (log distance
in m, k, n), scaled by flops.
"""
from __future__ import annotations

import math
from typing import Mapping

from .hardware import DTYPE_BYTES, Gpu

TILES = ((128, 256, 1.0), (256, 128, 1.0), (128, 128, 0.92), (64, 128, 0.80), (64, 64, 0.55))  # [est]
K0 = 128  # [est] K-loop fill and drain, in k elements


def tile_utilisation(m: int, n: int, sms: int) -> float:
    """The best (useful work / issued work) x tile rate over TILES, in (0, 1]."""
    best = 0.0
    for tm, tn, rate in TILES:
        tiles = math.ceil(m / tm) * math.ceil(n / tn)
        waves = math.ceil(tiles / sms)
        best = max(best, rate * (m * n) / (waves * sms * tm * tn))
    return best


class GemmModel:
    """Roofline GEMM times on `gpu` in `dtype` (module docstring)."""

    def __init__(self, gpu: Gpu, dtype: str = "bf16"):
        self.gpu, self.dtype = gpu, dtype
        self.peak = gpu.peak(dtype) * gpu.gemm_efficiency
        self.bytes = DTYPE_BYTES[dtype]
        self.hbm = gpu.hbm_gbps * 1e9 * gpu.hbm_efficiency
        self.kernel = gpu.kernel_us * 1e-6

    def time(self, m: int, k: int, n: int) -> float:
        """Seconds of y[m, n] = x[m, k] @ w[k, n] (0 for an empty GEMM)."""
        if m <= 0 or k <= 0 or n <= 0:
            return 0.0
        rate = self.peak * tile_utilisation(m, n, self.gpu.sms) * k / (k + K0)
        flops = 2.0 * m * k * n
        moved = (m * k + k * n + m * n) * self.bytes
        return self.kernel + max(flops / rate, moved / self.hbm)

    def elementwise(self, nbytes: float, passes: float = 3.0) -> float:
        """One memory-bound kernel touching `nbytes` `passes` times (an add: read two, write one)."""
        return self.kernel + passes * nbytes / self.hbm if nbytes > 0 else 0.0


class TableGemm(GemmModel):
    """Measured times: rows {(m, k, n): seconds}; a shape is priced from the nearest row, scaled by flops."""

    def __init__(self, gpu: Gpu, dtype: str, rows: Mapping[tuple[int, int, int], float]):
        super().__init__(gpu, dtype)
        if not rows:
            raise ValueError("TableGemm needs at least one measured (m, k, n) -> seconds row")
        self.rows = {tuple(int(v) for v in key): float(t) for key, t in rows.items()}

    def time(self, m: int, k: int, n: int) -> float:
        if m <= 0 or k <= 0 or n <= 0:
            return 0.0

        def dist(key):
            return sum(abs(math.log(a) - math.log(b)) for a, b in zip(key, (m, k, n)))

        key = min(self.rows, key=dist)
        return self.rows[key] * (m * k * n) / (key[0] * key[1] * key[2])
