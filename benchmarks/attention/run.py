"""Attention-block benchmark: query-split attention (TP+SP) and Flash all-to-all Ulysses (CP) vs stock.

    sudo .venv/bin/python benchmarks/attention/run.py --rate 1gbit     # -> out/attention/attention.md + _raw.json
    .venv/bin/python benchmarks/attention/run.py --unshaped            # host loopback (no root), labelled so
    .venv/bin/python benchmarks/attention/run.py --render benchmarks/attention/data/X_raw.json   # tables again

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
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if __name__ == "__main__":  # run as a script: the checkout's root on the path, not this folder
    sys.path[0] = ROOT

from benchmarks.attention.rows import summary, table  # noqa: E402
from benchmarks.harness.cli import before_run, out_dir, parser  # noqa: E402
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
    p.add_argument("--render", metavar="RAW", help="rewrite the tables of the markdown beside RAW (X_raw.json -> "
                   "X.md) from its samples (nothing is run; the title and command lines are kept)")
    return p.parse_args(argv)


def body(res: dict) -> str:
    """The tables of attention.md from its raw JSON: what --render rebuilds."""
    return "\n".join(["## Summary (a win or loss only where the 90 % interval excludes 1.0)", ""] + summary(res)
                     + ["", "## Every row", "", table(res)]) + "\n"


def main(argv=None) -> None:
    a = parse(argv)
    if (code := before_run(a, body, "attention/run.py")) is not None:
        return code
    cfg = {k: getattr(a, k) for k in ("seq", "batch", "hidden", "width", "head_dim", "repeats", "stock_rs")}
    res, link = run_on_link("benchmarks.attention.rows:main", a.world, cfg, a)
    text = (f"# Attention blocks ({datetime.date.today()})\n\nCommand: `{command_line('attention/run.py', argv)}`\n\n"
            f"P={res['world']}, {link}, seq={a.seq}, batch={a.batch}, hidden={a.hidden}, width={a.width}, "
            f"head_dim={a.head_dim}, causal, fp32, {a.repeats} rounds (medians of the max over ranks); "
            f"{STOCK_RS_LABEL[a.stock_rs]}\n\n{body(res)}")
    write_text(a.out, text)
    with open(os.path.splitext(a.out)[0] + "_raw.json", "w") as f:
        json.dump(res, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
