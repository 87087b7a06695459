"""DP gradient reduce-scatter inside the wgrad GEMM, and TP without SP (all-reduce), vs stock, on the
emulated link (2 ranks in a tbf-shaped network namespace; the bench harness's netns, timing and stats).

    sudo .venv/bin/python benchmarks/dp.py                        # results/dp.md (+ dp_raw.json)
    .venv/bin/python benchmarks/dp.py --unshaped --quick          # no root: host loopback, labelled

The rows and what each measures: megatron_flashoverlap/bench/dp_rows.py.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_flashoverlap.bench.dp_rows import table  # noqa: E402
from megatron_flashoverlap.bench.launch import run_ranks  # noqa: E402
from megatron_flashoverlap.bench.netns import shaped_namespace, why_not_shaped  # noqa: E402

RANKS = "megatron_flashoverlap.bench.dp_rows:main"


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", default="1gbit", help="tbf rates (comma list)")
    p.add_argument("--burst", default="512kb")
    p.add_argument("--seqs", default="512,1024", help="TP-without-SP sequence lengths")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--width", type=int, default=512, help="per-rank inner width of the TP MLP")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dp-n", type=int, default=1024, help="DP weight rows (W [n, k])")
    p.add_argument("--dp-k", type=int, default=512)
    p.add_argument("--dp-tokens", type=int, default=2048, help="tokens of the wgrad GEMM")
    p.add_argument("--ddp-layers", type=int, default=2, help="column+row blocks of the Megatron DDP rows")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--unshaped", action="store_true", help="host loopback, no root; labelled 'unshaped'")
    p.add_argument("--quick", action="store_true", help="tiny sizes, 1 repeat (smoke test)")
    p.add_argument("--out", default="results")
    p.add_argument("--timeout", type=float, default=3600.0)
    a = p.parse_args(argv)
    if a.quick:
        a.seqs, a.hidden, a.width, a.dp_n, a.dp_k, a.dp_tokens, a.repeats = "64", 64, 64, 64, 64, 64, 1
    return a


def runs(a, cfg: dict) -> list[dict]:
    """One run per rate in one shaped namespace (or one unshaped run on the host loopback)."""
    if a.unshaped:
        return [{**run_ranks(RANKS, 2, args=(cfg,), timeout=a.timeout)[0], "rate": "unshaped (host loopback)"}]
    out = []
    with shaped_namespace(None) as ns:
        for rate in a.rates.split(","):
            ns.shape_lo(rate, a.burst)
            out.append({**run_ranks(RANKS, 2, args=(cfg,), ns=ns, timeout=a.timeout)[0], "rate": rate})
    return out


def main(argv=None) -> int:
    a = parse(argv)
    if not a.unshaped and why_not_shaped():
        print(f"cannot shape the link: {why_not_shaped()}. Rerun with --unshaped (labelled).", file=sys.stderr)
        return 2
    cfg = {"seqs": [int(s) for s in a.seqs.split(",")], "hidden": a.hidden, "width": a.width, "batch": a.batch,
           "dp_n": a.dp_n, "dp_k": a.dp_k, "dp_tokens": a.dp_tokens, "ddp_layers": a.ddp_layers,
           "repeats": a.repeats, "burst": a.burst}
    results = runs(a, cfg)
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    cmd = "python benchmarks/dp.py " + " ".join(sys.argv[1:] if argv is None else argv)
    md = [f"# DP reduce-scatter in the wgrad GEMM, TP without SP ({now})", "", f"Command: `{cmd}`", ""]
    for run in results:
        md += [f"## link {run['rate']}, 2 ranks, W [{a.dp_n}, {a.dp_k}] fp32, TP MLP h={a.hidden} "
               f"w={a.width} b={a.batch}", "", table(run), ""]
    os.makedirs(a.out, exist_ok=True)
    text = "\n".join(md) + "\n"
    with open(os.path.join(a.out, "dp.md"), "w") as f:
        f.write(text)
    with open(os.path.join(a.out, "dp_raw.json"), "w") as f:
        json.dump(results, f)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
