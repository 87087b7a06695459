"""One prepared GPU check (< 8 minutes on one H200): writes out/gpu_check/gpu.md (and the raw JSON beside it).

    python benchmarks/gpu_check/run.py [--out out/gpu_check/gpu.md] [--budget-s 420] [--dry]

Parts (what each measures: benchmarks/gpu_check/check.py and multi.py):
(a) every public operator and one Flash layer, fwd+bwd, fake process group at P = 2, 4, 8: zero host syncs
(b) the cost of slicing each GEMM site's GEMM into P parts (d_model 4096 / 8192, 8k / 16k tokens, bf16)
(c) host overhead per ring step    (d) peak memory per operator    (e) CUDA graph capture and replay
(f) with two or more GPUs: NCCL numerics against stock and the overlap table (skipped on one GPU)
Megatron is not imported (the device machine may lack it). `--dry`, or a machine without CUDA, runs only
part (a)'s operator table on CPU (shapes and dtypes), says so, and exits 0.
"""
from __future__ import annotations

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if __name__ == "__main__":  # run as a script: the checkout's root on the path, not this folder
    sys.path[0] = ROOT

from benchmarks.harness.cli import out_dir, parser  # noqa: E402

NEEDS = ("It needs a CUDA GPU (two or more for part f) and no root; without one, or with --dry, it runs part (a)'s "
         "operator table on CPU, says so and exits 0.")


def main(argv=None) -> int:
    ap = parser(__doc__, "gpu_check", NEEDS)
    ap.add_argument("--out", default=os.path.join(out_dir("gpu_check"), "gpu.md"),
                    help="the markdown; its JSON beside it (default out/gpu_check/gpu.md)")
    ap.add_argument("--budget-s", type=float, default=420.0, help="the whole run stays within this many seconds")
    ap.add_argument("--dry", action="store_true", help="no GPU work: CPU operator table only, nothing measured")
    a = ap.parse_args(argv)
    import torch

    from benchmarks.gpu_check.report import markdown, run

    dry = a.dry or not torch.cuda.is_available()
    if dry:
        why = "--dry" if a.dry else "no CUDA device visible (torch.cuda.is_available() is False)"
        print(f"gpu_check: DRY RUN ({why}): the operator table runs on CPU on the fake process group; "
              f"nothing is measured on a GPU")
    res = run(a.budget_s, dry=dry)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        f.write(markdown(res))
    with open(os.path.splitext(a.out)[0] + ".json", "w") as f:
        json.dump(res, f, indent=1, default=str)
    errors = [p for p in "abcdef" if isinstance(res.get(p), dict) and "error" in res[p]]
    print(f"gpu_check: {res['meta']['device']}: wrote {a.out}" + (f"; parts with errors: {errors}" if errors else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
