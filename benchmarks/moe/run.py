"""MoE-layer benchmark: one Megatron MoE layer (alltoall dispatcher, expert-TP 1, SequentialMLP experts),
Megatron stock vs ours for every moe.algo of config.MOE_SITE_ALGOS (auto: the default), EP = 2 and 4, fwd and fwd+bwd, on the shaped link.

    sudo .venv/bin/python benchmarks/moe/run.py --worlds 2,4 --rates 1gbit,2gbit   # out/moe/moe.md + moe_raw.json
    .venv/bin/python benchmarks/moe/run.py --unshaped --quick                      # no root: host loopback, labelled
    .venv/bin/python benchmarks/moe/run.py --render benchmarks/moe/data/ep_raw.json  # tables again from samples

Per row: block, compute alone (the EP exchange on a fake group), comm alone (expert ffn 1), the estimator's
hidden fraction and distance to the bound with 90 % intervals, and the speedup vs stock (a win only where
its interval excludes 1.0): benchmarks/moe/rows.py says what each measures. On a shared
CPU box absolute times are noise; compare rows of one run.
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if __name__ == "__main__":  # run as a script: the checkout's root on the path, not this folder
    sys.path[0] = ROOT

from benchmarks.harness.cli import before_run, out_dir, parser  # noqa: E402
from benchmarks.moe import table as moe_table  # noqa: E402
from benchmarks.harness.launch import command_line, run_ranks, write_results  # noqa: E402
from benchmarks.harness.netns import shaped_namespace  # noqa: E402

RANKS = "benchmarks.moe.rows:main"
SHAPE = ("tokens", "hidden", "ffn", "experts", "topk", "repeats")


def parse(argv=None) -> argparse.Namespace:
    p = parser(__doc__, "moe")
    p.add_argument("--worlds", default="2,4", help="EP sizes (comma list; EP = ranks, TP = 1)")
    p.add_argument("--rates", default="1gbit", help="tbf rates of the namespace's loopback (comma list)")
    p.add_argument("--burst", default="512kb")
    p.add_argument("--tokens", type=int, default=2048, help="tokens per rank")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--ffn", type=int, default=1024, help="expert ffn size")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--repeats", type=int, default=7, help="kept rounds (one warm-up round more)")
    p.add_argument("--unshaped", action="store_true", help="host loopback, no namespace (no root); labelled")
    p.add_argument("--quick", action="store_true", help="tiny shapes, EP=2, 2 rounds (smoke test, not a result)")
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--out", default=out_dir("moe"), help="folder for moe.md and moe_raw.json (default out/moe/)")
    p.add_argument("--render", metavar="RAW", help="rewrite the tables of the markdown beside RAW (X_raw.json -> "
                   "X.md) from its samples (nothing is run; the title and command lines are kept)")
    a = p.parse_args(argv)
    if a.quick:
        a.worlds, a.tokens, a.hidden, a.ffn, a.experts, a.repeats = "2", 64, 32, 32, 4, 2
    return a


def runs(a, cfg: dict) -> list[dict]:
    """One run per (rate, EP) in one shaped namespace (re-shaped between rates), or unshaped per EP."""
    worlds = [int(w) for w in a.worlds.split(",")]
    if a.unshaped:
        return [{**run_ranks(RANKS, w, args=(cfg,), timeout=a.timeout)[0], "rate": "unshaped (host loopback)"}
                for w in worlds]
    out = []
    with shaped_namespace(None) as ns:
        for rate in a.rates.split(","):
            ns.shape_lo(rate, a.burst)
            out += [{**run_ranks(RANKS, w, args=(cfg,), ns=ns, timeout=a.timeout)[0], "rate": f"tbf {rate}"}
                    for w in worlds]
    return out


def body(results: list[dict]) -> str:
    """The sections of moe.md from moe_raw.json (one run per EP and link): what --render rebuilds."""
    md = ["## Summary", ""] + moe_table.summary(results) + [""]
    for run in results:
        md += [f"## {moe_table.header(run)}", "", moe_table.table(run), ""]
    return "\n".join(md) + "\n"


def report(results: list[dict], cmd: str) -> str:
    md = [f"# MoE layer: Megatron stock vs ours ({datetime.date.today()}, {os.cpu_count()} cores)",
          "", f"Command: `{cmd}`", "",
          "compute alone = the same layer with its EP exchange on a fake group (transfers complete at once; routing, "
          "split sizes and expert GEMMs unchanged); comm alone = the same routes with expert ffn 1 (it still pays "
          "routing and permutation, so hidden errs high by that much); exposed = block - compute; hidden = 1 - "
          "exposed / comm; to bound = block / max(compute, comm); vs stock: a win only where the 90 % interval "
          "excludes 1.0.", ""]
    return "\n".join(md) + "\n" + body(results)


def main(argv=None) -> int:
    a = parse(argv)
    if (code := before_run(a, body, "moe/run.py")) is not None:
        return code
    results = runs(a, {k: getattr(a, k) for k in SHAPE})
    text = report(results, command_line("moe/run.py", argv))
    write_results(a.out, "moe", text, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
