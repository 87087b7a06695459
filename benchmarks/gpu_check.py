"""One prepared GPU check (< 5 minutes, one GPU): do the FlashOverlap premises hold on this device?

    python benchmarks/gpu_check.py [--out results/gpu_check.json] [--budget-s 240]

(a) GEMM slicing cost (unsplit vs P row slices) and (b) side-stream copy / GEMM overlap; what each
measures: megatron_flashoverlap/bench/gpu_check.py. Writes a small JSON (device name, torch/CUDA versions,
date, both tables). Without CUDA it exits with status 3 and a message, so it can be imported and run anywhere.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


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
    from megatron_flashoverlap.bench.gpu_check import run

    res = run(a.budget_s)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    eff = [r["efficiency"] for r in res["slicing"]]
    print(f"{res['device']}: slicing efficiency min {min(eff):.2f} median {sorted(eff)[len(eff) // 2]:.2f}; "
          f"side-stream copy hides {100 * res['copy_overlap']['hidden_of_shorter']:.0f}% of the shorter; -> {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
