"""Host overhead per call and per ring step of every public operator, flash vs reference, on torch's fake
process group (transfers complete at once, tensors are tiny: what is left is the host's cost).

    .venv/bin/python benchmarks/host_overhead.py                      # P = 2, 4, 8 -> results/host_overhead.md
    .venv/bin/python benchmarks/host_overhead.py --worlds 8 --calls 100 --out /tmp/h.md

What each column measures: megatron_flashoverlap/bench/host_overhead.py. One process, no network, no root.
Absolute microseconds on a shared machine are noisy; compare rows of one run.
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_flashoverlap.bench.host_overhead import markdown, rows  # noqa: E402
from megatron_flashoverlap.bench.launch import command_line  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worlds", default="2,4,8", help="fake group sizes (comma list)")
    p.add_argument("--calls", type=int, default=200, help="back-to-back calls per sample")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (median; one warm-up round more)")
    p.add_argument("--out", default="results/host_overhead.md")
    a = p.parse_args(argv)
    table = markdown(rows(tuple(int(w) for w in a.worlds.split(",")), a.calls, a.rounds))
    print(table)
    if a.out:
        import torch
        cmd = command_line("host_overhead.py", argv)
        with open(a.out, "w") as f:
            f.write(f"# Host overhead on the fake process group\n\n`{cmd.strip()}` ({datetime.date.today()}, "
                    f"torch {torch.__version__}, {os.cpu_count()} CPUs)\n\n{table}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
