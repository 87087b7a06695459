"""Measurements of benchmarks/gpu_check.py: do the FlashOverlap premises hold on this device (one GPU)?

(a) GEMM slicing cost: bf16 y = x @ W^T at d_model 4096 shapes (the fc1 / fc2 / qkv / proj GEMMs of one TP
    rank at P = 2, 4, 8), unsplit vs split into P row slices (the Flash-AG / Flash-RS slices): the summed
    time of the P slices against one whole GEMM. Efficiency = unsplit / sum(slices), 1.0 = free to split.
(b) Copy/GEMM overlap: a device-to-device copy on a side stream (what a P2P transfer does to memory) while
    a GEMM runs on the main stream: overlapped wall time vs GEMM alone + copy alone. hidden = the share
    of the shorter one that disappeared.
Timing: bench/rounds.py `interleaved` over the variants of one point (CUDA events, 2 warm-up rounds,
10 rounds), a figure = the upper median sorted(t)[n // 2] of the rounds.
"""
from __future__ import annotations

import datetime
import time

import torch

from .rounds import cuda_timed, interleaved

D_MODEL = 4096
TOKENS = (4096, 8192, 16384)  # s * b of one micro-batch (sequence 4K-16K at b = 1)
PARTS = (2, 4, 8)
ROUNDS, WARMUP = 10, 2


def shapes(p: int) -> dict:
    """GEMM sites of one rank at TP = p: name -> (K, N) of y [tokens, N] = x [tokens, K] @ W^T."""
    h, f = D_MODEL, 4 * D_MODEL
    return {"fc1": (h, f // p), "fc2": (f // p, h), "qkv": (h, 3 * h // p), "proj": (h // p, h)}


def cuda_medians(fns: dict) -> dict:
    """{name: upper-median seconds} of fns interleaved per round on CUDA events."""
    samples = interleaved({k: (lambda fn=fn: cuda_timed(fn)) for k, fn in fns.items()}, ROUNDS, warmup=WARMUP)
    return {k: sorted(ts)[len(ts) // 2] for k, ts in samples.items()}


def slicing_cost(tokens: int, p: int, k: int, n: int) -> dict:
    x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    y = torch.empty(tokens, n, device="cuda", dtype=torch.bfloat16)
    rows = tokens // p

    def sliced():
        for i in range(p):
            torch.matmul(x[i * rows:(i + 1) * rows], w.t(), out=y[i * rows:(i + 1) * rows])
    t = cuda_medians({"whole": lambda: torch.matmul(x, w.t(), out=y), "sliced": sliced})
    whole, split = t["whole"], t["sliced"]
    tflops = 2.0 * tokens * k * n / whole / 1e12
    return {"tokens": tokens, "P": p, "K": k, "N": n, "unsplit_ms": whole * 1e3, "sliced_ms": split * 1e3,
            "efficiency": whole / split, "unsplit_tflops": tflops}


def copy_overlap(tokens: int = 8192, mib: int = 256) -> dict:
    x = torch.randn(tokens, D_MODEL, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4 * D_MODEL // 2, D_MODEL, device="cuda", dtype=torch.bfloat16)
    src = torch.empty(mib * 2 ** 20, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    side = torch.cuda.Stream()
    gemm = lambda: torch.matmul(x, w.t())  # noqa: E731
    copy = lambda: dst.copy_(src, non_blocking=True)  # noqa: E731

    def both():
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            copy()
        gemm()
        torch.cuda.current_stream().wait_stream(side)
    t = cuda_medians({"gemm": gemm, "copy": copy, "both": both})
    tg, tc, tb = t["gemm"], t["copy"], t["both"]
    return {"gemm_ms": tg * 1e3, "copy_ms": tc * 1e3, "copy_MiB": mib, "overlapped_ms": tb * 1e3,
            "serial_ms": (tg + tc) * 1e3, "hidden_of_shorter": (tg + tc - tb) / min(tg, tc)}


def run(budget_s: float) -> dict:
    t0 = time.monotonic()
    res = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "cuda": torch.version.cuda,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "dtype": "bfloat16", "d_model": D_MODEL, "slicing": [], "copy_overlap": copy_overlap()}
    for tokens in TOKENS:
        for p in PARTS:
            for site, (k, n) in shapes(p).items():
                if time.monotonic() - t0 > budget_s:
                    res["stopped_early"] = f"time budget {budget_s:.0f} s reached"
                    return res
                res["slicing"].append({"site": site, **slicing_cost(tokens, p, k, n)})
    return res
