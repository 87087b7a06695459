"""Attention-block benchmark: query-split attention (TP+SP) and Flash all-to-all Ulysses (CP) vs stock.

    sudo .venv/bin/python benchmarks/attention.py --rate 1gbit     # ranks in a tbf-shaped namespace
    .venv/bin/python benchmarks/attention.py --unshaped            # host loopback (no root), labelled so

Blocks (megatron_flashoverlap/bench/attention_blocks.py): "qsa" = AG+QKV GEMM, then attention + proj + RS
(stock: attention, GEMM, RS; slicing k: attention, sliced GEMM+RS; flash: query split in Flash-RS order),
"qsa_zigzag" = the same with zigzag-balanced causal blocks, "ulysses" = QKV GEMM, a2a, attention, a2a,
proj GEMM (stock: all_to_all_single; flash: GEMMs inside the pairwise a2a steps). What each column
measures: megatron_flashoverlap/bench/attention_rows.py. On a shared 2-core VM absolute times are noise;
compare rows of one run.
"""
from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_flashoverlap.bench.attention_rows import table  # noqa: E402
from megatron_flashoverlap.bench.launch import STOCK_RS_LABEL, add_link_args, run_on_link, write_text  # noqa: E402


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--width", type=int, default=256, help="qsa: per-rank heads*head_dim; ulysses: all heads")
    p.add_argument("--head-dim", type=int, default=64)
    add_link_args(p, "results/attention.md")
    return p.parse_args(argv)


def main(argv=None) -> None:
    a = parse(argv)
    cfg = {k: getattr(a, k) for k in ("seq", "batch", "hidden", "width", "head_dim", "repeats", "stock_rs")}
    res, link = run_on_link("megatron_flashoverlap.bench.attention_rows:main", a.world, cfg, a)
    text = (f"P={res['world']}, {link}, seq={a.seq}, batch={a.batch}, hidden={a.hidden}, width={a.width}, "
            f"head_dim={a.head_dim}, causal, fp32, medians of {a.repeats}; {STOCK_RS_LABEL[a.stock_rs]}\n\n"
            f"{table(res)}\n")
    write_text(a.out, text)


if __name__ == "__main__":
    main()
