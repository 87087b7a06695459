"""Attention-block benchmark: query-split attention (TP+SP) and Flash all-to-all Ulysses (CP) vs stock.

    sudo .venv/bin/python benchmarks/attention/run.py --rate 1gbit     # -> out/attention/attention.md
    .venv/bin/python benchmarks/attention/run.py --unshaped            # host loopback (no root), labelled so

Blocks (benchmarks/attention/blocks.py): "qsa" = AG+QKV GEMM, then attention + proj + RS
(stock: attention, GEMM, RS; slicing k: attention, sliced GEMM+RS; flash: query split in Flash-RS order),
"qsa_zigzag" = the same with zigzag-balanced causal blocks, "ulysses" = QKV GEMM, a2a, attention, a2a,
proj GEMM (stock: all_to_all_single; flash: GEMMs inside the pairwise a2a steps). What each column
measures: benchmarks/attention/rows.py. On a shared 2-core VM absolute times are noise;
compare rows of one run.
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if __name__ == "__main__":  # run as a script: the checkout's root on the path, not this folder
    sys.path[0] = ROOT

from benchmarks.attention.rows import table  # noqa: E402
from benchmarks.harness.cli import out_dir, parser  # noqa: E402
from benchmarks.harness.launch import STOCK_RS_LABEL, add_link_args, command_line, run_on_link, write_text  # noqa: E402


def parse(argv=None) -> argparse.Namespace:
    p = parser(__doc__, "attention")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--width", type=int, default=256, help="qsa: per-rank heads*head_dim; ulysses: all heads")
    p.add_argument("--head-dim", type=int, default=64)
    add_link_args(p, os.path.join(out_dir("attention"), "attention.md"))
    return p.parse_args(argv)


def main(argv=None) -> None:
    a = parse(argv)
    cfg = {k: getattr(a, k) for k in ("seq", "batch", "hidden", "width", "head_dim", "repeats", "stock_rs")}
    res, link = run_on_link("benchmarks.attention.rows:main", a.world, cfg, a)
    text = (f"# Attention blocks ({datetime.date.today()})\n\nCommand: `{command_line('attention/run.py', argv)}`\n\n"
            f"P={res['world']}, {link}, seq={a.seq}, batch={a.batch}, hidden={a.hidden}, width={a.width}, "
            f"head_dim={a.head_dim}, causal, fp32, medians of {a.repeats}; {STOCK_RS_LABEL[a.stock_rs]}\n\n"
            f"{table(res)}\n")
    write_text(a.out, text)


if __name__ == "__main__":
    main()
