"""MoE-layer benchmark: one Megatron MoE layer (alltoall dispatcher), stock all_to_all_single vs ours, EP = P.

    sudo .venv/bin/python benchmarks/moe.py --world 2 --rate 1gbit   # ranks in a tbf-shaped namespace
    .venv/bin/python benchmarks/moe.py --world 4 --unshaped          # host loopback (no root), labelled so

What each column measures: megatron_flashoverlap/bench/moe_rows.py. On a shared 2-core VM absolute times
are noise; compare rows of one run.
"""
from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_flashoverlap.bench.launch import add_link_args, run_on_link, write_text  # noqa: E402
from megatron_flashoverlap.bench.moe_rows import table  # noqa: E402


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=2, help="EP size (2 or 4)")
    p.add_argument("--tokens", type=int, default=1024, help="tokens per rank")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=512, help="expert ffn size")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    add_link_args(p, "results/moe.md")
    return p.parse_args(argv)


def main(argv=None) -> None:
    a = parse(argv)
    cfg = {k: getattr(a, k) for k in ("tokens", "hidden", "ffn", "experts", "topk", "repeats")}
    res, link = run_on_link("megatron_flashoverlap.bench.moe_rows:main", a.world, cfg, a)
    text = (f"EP={res['world']}, {link}, tokens/rank={a.tokens}, hidden={a.hidden}, ffn={a.ffn}, "
            f"experts={a.experts}, top-{a.topk}, fp32, medians of {a.repeats}\n\n{table(res)}\n")
    write_text(a.out, text)


if __name__ == "__main__":
    main()
