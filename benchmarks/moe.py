"""MoE-layer benchmark: one Megatron MoE layer (alltoall dispatcher, expert-TP 1, SequentialMLP experts),
Megatron stock vs ours for every word of config.MOE_ALGOS, EP = 2 and 4, fwd and fwd+bwd, on the shaped link.

    sudo .venv/bin/python benchmarks/moe.py --worlds 2,4 --rates 1gbit,2gbit   # results/moe.md + moe_raw.json
    .venv/bin/python benchmarks/moe.py --unshaped --quick                      # no root: host loopback, labelled

Per row: block, compute alone (the EP exchange on a fake group), comm alone (expert ffn 1), the estimator's
hidden fraction and distance to the bound with 90 % intervals, and the speedup vs stock (a win only where
its interval excludes 1.0): megatron_flashoverlap/bench/moe_rows.py says what each measures. On a shared
CPU box absolute times are noise; compare rows of one run.
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_flashoverlap.bench import moe_table  # noqa: E402
from megatron_flashoverlap.bench.launch import command_line, run_ranks, write_results  # noqa: E402
from megatron_flashoverlap.bench.netns import shaped_namespace, why_not_shaped  # noqa: E402

RANKS = "megatron_flashoverlap.bench.moe_rows:main"
SHAPE = ("tokens", "hidden", "ffn", "experts", "topk", "repeats")


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    p.add_argument("--out", default="results")
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


def report(results: list[dict], cmd: str) -> str:
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    md = [f"# MoE layer: Megatron stock vs ours ({now}, load {os.getloadavg()[0]:.1f}, {os.cpu_count()} cores)",
          "", f"Command: `{cmd}`", "",
          "compute alone = the same layer with its EP exchange on a fake group (transfers complete at once; routing, "
          "split sizes and expert GEMMs unchanged); comm alone = the same routes with expert ffn 1 (it still pays "
          "routing and permutation, so hidden errs high by that much); exposed = block - compute; hidden = 1 - "
          "exposed / comm; to bound = block / max(compute, comm); vs stock: a win only where the 90 % interval "
          "excludes 1.0.", "", "## Summary", ""] + moe_table.summary(results) + [""]
    for run in results:
        md += [f"## {moe_table.header(run)}", "", moe_table.table(run), ""]
    return "\n".join(md) + "\n"


def main(argv=None) -> int:
    a = parse(argv)
    if not a.unshaped and why_not_shaped():
        print(f"cannot shape the link: {why_not_shaped()}. Rerun with --unshaped (labelled).", file=sys.stderr)
        return 2
    results = runs(a, {k: getattr(a, k) for k in SHAPE})
    text = report(results, command_line("moe.py", argv))
    write_results(a.out, "moe", text, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
