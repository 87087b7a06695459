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
import contextlib
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_flashoverlap.bench.attention_rows import table  # noqa: E402
from megatron_flashoverlap.bench.launch import run_ranks  # noqa: E402
from megatron_flashoverlap.bench.netns import shaped_namespace  # noqa: E402


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--width", type=int, default=256, help="qsa: per-rank heads*head_dim; ulysses: all heads")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--rate", default="1gbit", help="tbf rate of the namespace's loopback")
    p.add_argument("--unshaped", action="store_true", help="host loopback, no namespace (no root needed)")
    p.add_argument("--timeout", type=float, default=3600.0)
    p.add_argument("--out", default="results/attention.md")
    return p.parse_args(argv)


def main(argv=None) -> None:
    a = parse(argv)
    cfg = {k: getattr(a, k) for k in ("seq", "batch", "hidden", "width", "head_dim", "repeats")}
    with (contextlib.nullcontext(None) if a.unshaped else shaped_namespace(a.rate)) as ns:
        res = run_ranks("megatron_flashoverlap.bench.attention_rows:main", a.world, args=(cfg,), ns=ns,
                        timeout=a.timeout)[0]
    link = "unshaped loopback" if a.unshaped else f"tbf {a.rate}"
    text = (f"P={res['world']}, {link}, seq={a.seq}, batch={a.batch}, hidden={a.hidden}, width={a.width}, "
            f"head_dim={a.head_dim}, causal, fp32, medians of {a.repeats}\n\n{table(res)}\n")
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
