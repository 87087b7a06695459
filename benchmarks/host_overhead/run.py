"""Host overhead per call and per ring step of every public operator, flash vs reference, on torch's fake
process group (transfers complete at once, tensors are tiny: what is left is the host's cost).

    .venv/bin/python benchmarks/host_overhead/run.py                      # P = 2, 4, 8 -> out/host_overhead/
    .venv/bin/python benchmarks/host_overhead/run.py --worlds 8 --calls 100 --out /tmp/h.md

What each column measures: benchmarks/host_overhead/rows.py. One process, no network, no root.
Absolute microseconds on a shared machine are noisy; compare rows of one run.
"""
from __future__ import annotations

import datetime
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if __name__ == "__main__":  # run as a script: the checkout's root on the path, not this folder
    sys.path[0] = ROOT

from benchmarks.harness.cli import NO_ROOT, out_dir, parser  # noqa: E402
from benchmarks.harness.launch import command_line, write_text  # noqa: E402
from benchmarks.host_overhead.rows import markdown, rows  # noqa: E402


def main(argv=None) -> int:
    p = parser(__doc__, "host_overhead", NO_ROOT)
    p.add_argument("--worlds", default="2,4,8", help="fake group sizes (comma list)")
    p.add_argument("--calls", type=int, default=200, help="back-to-back calls per sample")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (median; one warm-up round more)")
    p.add_argument("--out", default=os.path.join(out_dir("host_overhead"), "host_overhead.md"),
                   help="the markdown ('' for none; default out/host_overhead/host_overhead.md)")
    a = p.parse_args(argv)
    table = markdown(rows(tuple(int(w) for w in a.worlds.split(",")), a.calls, a.rounds))
    if not a.out:
        print(table)
        return 0
    import torch
    cmd = command_line("host_overhead/run.py", argv)
    write_text(a.out, f"# Host overhead on the fake process group\n\n`{cmd.strip()}` ({datetime.date.today()}, "
                      f"torch {torch.__version__}, {os.cpu_count()} CPUs)\n\n{table}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
