"""One prepared GPU check (< 5 minutes, one GPU): do the FlashOverlap premises hold on this device?

    python benchmarks/gpu_check.py [--out results/gpu_check.json] [--budget-s 240]

(a) GEMM slicing cost: bf16 y = x @ W^T at d_model 4096 shapes (the fc1 / fc2 / qkv / proj GEMMs of one TP
    rank at P = 2, 4, 8), unsplit vs split into P row slices (the Flash-AG / Flash-RS slices): the summed
    time of the P slices against one whole GEMM. Efficiency = unsplit / sum(slices), 1.0 = free to split.
(b) Copy/GEMM overlap: a device-to-device copy on a side stream (what a P2P transfer does to memory) while
    a GEMM runs on the main stream: overlapped wall time vs GEMM alone + copy alone. hidden = the share
    of the shorter one that disappeared.
Writes a small JSON (device name, torch/CUDA versions, date, both tables). Without CUDA it exits with
status 3 and a message, so it can be imported and run anywhere.
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
import time

D_MODEL = 4096
TOKENS = (4096, 8192, 16384)  # s * b of one micro-batch (sequence 4K-16K at b = 1)
PARTS = (2, 4, 8)


def shapes(p: int) -> dict:
    """GEMM sites of one rank at TP = p: name -> (K, N) of y [tokens, N] = x [tokens, K] @ W^T."""
    h, f = D_MODEL, 4 * D_MODEL
    return {"fc1": (h, f // p), "fc2": (f // p, h), "qkv": (h, 3 * h // p), "proj": (h // p, h)}


def cuda_time(fn, reps: int = 10) -> float:
    """Median seconds of fn() measured with CUDA events, after two warm-up calls."""
    import torch
    for _ in range(2):
        fn()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / 1e3)
    return sorted(ts)[len(ts) // 2]


def slicing_cost(tokens: int, p: int, k: int, n: int) -> dict:
    import torch
    x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    y = torch.empty(tokens, n, device="cuda", dtype=torch.bfloat16)
    rows = tokens // p
    whole = cuda_time(lambda: torch.matmul(x, w.t(), out=y))

    def sliced():
        for i in range(p):
            torch.matmul(x[i * rows:(i + 1) * rows], w.t(), out=y[i * rows:(i + 1) * rows])
    split = cuda_time(sliced)
    tflops = 2.0 * tokens * k * n / whole / 1e12
    return {"tokens": tokens, "P": p, "K": k, "N": n, "unsplit_ms": whole * 1e3, "sliced_ms": split * 1e3,
            "efficiency": whole / split, "unsplit_tflops": tflops}


def copy_overlap(tokens: int = 8192, mib: int = 256) -> dict:
    import torch
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
    tg, tc, tb = cuda_time(gemm), cuda_time(copy), cuda_time(both)
    hidden = (tg + tc - tb) / min(tg, tc)
    return {"gemm_ms": tg * 1e3, "copy_ms": tc * 1e3, "copy_MiB": mib, "overlapped_ms": tb * 1e3,
            "serial_ms": (tg + tc) * 1e3, "hidden_of_shorter": hidden}


def run(budget_s: float) -> dict:
    import torch
    t0 = time.monotonic()
    res = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "cuda": torch.version.cuda,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "dtype": "bfloat16", "d_model": D_MODEL, "slicing": [], "copy_overlap": None}
    res["copy_overlap"] = copy_overlap()
    for tokens in TOKENS:
        for p in PARTS:
            for site, (k, n) in shapes(p).items():
                if time.monotonic() - t0 > budget_s:
                    res["stopped_early"] = f"time budget {budget_s:.0f} s reached"
                    return res
                res["slicing"].append({"site": site, **slicing_cost(tokens, p, k, n)})
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="results/gpu_check.json")
    ap.add_argument("--budget-s", type=float, default=240.0, help="stop the sweep after this many seconds")
    a = ap.parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible (torch.cuda.is_available() is False); this script measures a "
              "GPU and does nothing on CPU. Run it on a machine with one NVIDIA GPU.", file=sys.stderr)
        return 3
    res = run(a.budget_s)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    eff = [r["efficiency"] for r in res["slicing"]]
    print(f"{res['device']}: slicing efficiency min {min(eff):.2f} median {sorted(eff)[len(eff) // 2]:.2f}; "
          f"side-stream copy hides {100 * res['copy_overlap']['hidden_of_shorter']:.0f}% of the shorter; -> {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
