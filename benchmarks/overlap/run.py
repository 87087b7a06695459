"""Overlap benchmark: stock vs data slicing (k=2,4,8) vs FlashOverlap over an emulated (tbf-shaped) link.

    sudo .venv/bin/python benchmarks/overlap/run.py                 # full sweep -> out/overlap/overlap.{md,png,...}
    .venv/bin/python benchmarks/overlap/run.py --unshaped --quick   # no root: host loopback, labelled unshaped
    .venv/bin/python benchmarks/overlap/run.py --render benchmarks/overlap/data/point_raw.json   # tables again

Writes into --out: overlap.md (tables, cost model, verdict), overlap_seq.png (hidden fraction and distance
to bound vs sequence length), overlap_rates.png (vs link rate), overlap_trace.json (chrome://tracing or
ui.perfetto.dev: one block per method per rank) and overlap_timeline.png (the same drawn as bars),
overlap_raw.json (every median and spread; `--render RAW` rebuilds the tables of the markdown beside it).
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if __name__ == "__main__":  # run as a script: the checkout's root on the path, not this folder
    sys.path[0] = ROOT

from benchmarks.harness.blocks import METHODS, operator_methods  # noqa: E402
from benchmarks.harness.cli import before_run, out_dir, parser  # noqa: E402
from benchmarks.harness.launch import STOCK_RS_LABEL, add_stock_rs_arg, command_line, run_ranks  # noqa: E402
from benchmarks.harness.netns import shaped_namespace, why_not_shaped  # noqa: E402
from benchmarks.overlap import table as report  # noqa: E402


def _ints(s: str) -> list[int]:
    return [int(v) for v in s.split(",") if v]


def parse(argv=None) -> argparse.Namespace:
    p = parser(__doc__, "overlap")
    p.add_argument("--rates", default="4gbit", help="tbf rates of the sequence sweep (comma list)")
    p.add_argument("--seqs", default="128,256,512,1024,2048", help="full sequence lengths (CPU analog of 1K-16K)")
    p.add_argument("--rate-sweep", default="250mbit,1gbit,2gbit",
                   help="'' to skip; the sequence-sweep run joins the rate plot when it covers --rate-sweep-seq")
    p.add_argument("--rate-sweep-seq", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--width", type=int, default=512, help="per-rank inner width (ffn/P; heads/P*head_dim)")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--kinds", default="mlp,attn")
    p.add_argument("--attn-max-seq", type=int, default=512, help="attention block only up to this length")
    p.add_argument("--burst", default="512kb")
    p.add_argument("--unshaped", action="store_true", help="run on the host loopback (no root needed), labelled")
    p.add_argument("--quick", action="store_true", help="tiny sizes, one rate, 1 repeat (smoke test)")
    p.add_argument("--no-megatron", dest="megatron", action="store_false",
                   help="skip the rows of the real Megatron MLP (stock spec vs ours)")
    p.add_argument("--methods", default="", help="comma list of table rows to run (default: every method; "
                   "the verdict needs stock, flash and a slicing k)")
    add_stock_rs_arg(p)
    p.add_argument("--out", default=out_dir("overlap"), help="folder for the files above (default out/overlap/)")
    p.add_argument("--render", metavar="RAW", help="rewrite the tables of the markdown beside RAW (X_raw.json -> "
                   "X.md) from its samples (nothing is run; the title and command lines are kept)")
    a = p.parse_args(argv)
    if a.quick:
        a.seqs, a.hidden, a.width, a.head_dim, a.repeats, a.rate_sweep = "64,128", 64, 128, 32, 1, ""
    return a


def config(a, seqs: list[int]) -> dict:
    """The worker's CONFIG; the layers' `auto` runs in the Megatron rows only (operators have no auto)."""
    chosen = [m for m in METHODS if not a.methods or m.name in a.methods.split(",")]
    return {"kinds": a.kinds.split(","), "seqs": seqs, "batch": a.batch, "hidden": a.hidden, "width": a.width,
            "head_dim": a.head_dim, "repeats": a.repeats, "attn_max_seq": a.attn_max_seq,
            "methods": [m.name for m in operator_methods(chosen)],
            "trace": {"kind": "mlp", "seq": seqs[len(seqs) // 2], "methods": ["stock", "slicing k=4", "flash"]},
            "megatron": {"seq": seqs[len(seqs) // 2], "methods": [m.name for m in chosen]} if a.megatron else None,
            "stock_rs": a.stock_rs}


def run_rates(cfg: dict, rates: list[str], burst: str = "512kb", unshaped: bool = False,
              timeout: float = 3600.0, world: int = 2) -> list[dict]:
    """The overlap worker once per link rate in one namespace (`tc qdisc replace` between runs), deleted at
    the end, also on errors and Ctrl-C; `unshaped=True`: the host loopback, runs labelled "unshaped"."""
    if not unshaped and why_not_shaped():
        raise PermissionError(why_not_shaped())
    outs = []
    with (contextlib.nullcontext(None) if unshaped else shaped_namespace(None)) as ns:
        for rate in (["unshaped"] if unshaped else rates):
            if ns is not None:
                ns.shape_lo(rate, burst)
            out = run_ranks("benchmarks.overlap.worker:main", world, args=({**cfg, "label": f"link {rate}"},),
                            ns=ns, timeout=timeout)[0]
            outs.append({**out, "rate": rate if ns is not None else "unshaped (host loopback)",
                         "cpus": os.cpu_count()})
    return outs


def body(raw: dict) -> str:
    """The sections of overlap.md from overlap_raw.json ({"seq_runs", "rate_runs"}): what --render rebuilds."""
    seq_runs, rate_runs = raw["seq_runs"], raw["rate_runs"]
    md = []
    for run in seq_runs:
        md += [f"## Sequence sweep, {report.header(run)}", "", report.table(run), "",
               "Cost model's choice per GEMM site (at s = %d):" % run["config"]["trace"]["seq"], ""]
        md += report.site_lines(run, run["config"]["trace"]["seq"]) + [""]
        if run.get("megatron_rows"):
            md += ["Real Megatron-Core MLP (TP=2, SP), stock local spec vs our spec (block time only):", "",
                   report.megatron_table(run), ""]
    md += ["\\* model: the cost model's prediction from link bandwidth + GEMM throughput, both calibrated on the "
           "stock forward row of the same point (its compute alone and comm alone); every other row is predicted.",
           "", report.model_error(seq_runs + rate_runs), ""]
    md += ["## Summary (every swept point, losses included; a win only where the 90 % interval excludes 1.0)",
           ""] + report.summary(seq_runs + rate_runs) + [""]
    md += ["## Verdict (flash vs the bound, vs stock and vs the best slicing k)", ""] + report.VERDICT_HEAD
    for run in seq_runs:
        for kind in run["config"]["kinds"]:
            for mode in ("fwd", "fwd+bwd"):
                md += report.verdict(run, kind, mode)
    for run in rate_runs:
        md += report.verdict(run, "mlp", "fwd") + report.verdict(run, "mlp", "fwd+bwd")
    md += report.hop_chunk_section(seq_runs + rate_runs)
    if rate_runs:
        md += ["", f"## Link-rate sweep at s = {rate_runs[0]['config']['seqs'][0]}", ""]
        for run in rate_runs:
            md += [f"### {report.header(run)}", "", report.table(run), ""]
    return "\n".join(md) + "\n"


def write(a, seq_runs: list[dict], rate_runs: list[dict], cmd: str) -> str:
    """overlap.md, overlap_raw.json and the plots and trace into a.out; -> the markdown."""
    os.makedirs(a.out, exist_ok=True)
    label = STOCK_RS_LABEL[a.stock_rs]
    head = [f"# Overlap benchmark ({datetime.date.today()})", "", f"Command: `{cmd}`", "",
            label[0].upper() + label[1:] + ".", ""]
    raw = {"seq_runs": [{k: v for k, v in r.items() if k != "traces"} for r in seq_runs],
           "rate_runs": [{k: v for k, v in r.items() if k != "traces"} for r in rate_runs]}
    if rate_runs:
        joined = rate_runs + [r for r in seq_runs if a.rate_sweep_seq in r["config"]["seqs"]
                              and r["rate"] not in [q["rate"] for q in rate_runs]]
        report.plot_rates(joined, a.rate_sweep_seq, os.path.join(a.out, "overlap_rates.png"))
    report.plot(seq_runs, os.path.join(a.out, "overlap_seq.png"))
    report.trace(seq_runs[0]["traces"], os.path.join(a.out, "overlap_trace.json"))
    report.timeline_png(seq_runs[0]["traces"], os.path.join(a.out, "overlap_timeline.png"))
    with open(os.path.join(a.out, "overlap_raw.json"), "w") as f:
        json.dump(raw, f)
    text = "\n".join(head) + "\n" + body(raw)
    with open(os.path.join(a.out, "overlap.md"), "w") as f:
        f.write(text)
    return text


def main(argv=None) -> int:
    a = parse(argv)
    if (code := before_run(a, body, "overlap/run.py")) is not None:
        return code
    cmd = command_line("overlap/run.py", argv)
    seq_runs = run_rates(config(a, _ints(a.seqs)), a.rates.split(","), a.burst, a.unshaped)
    rate_runs = []
    if a.rate_sweep and not a.unshaped:
        rcfg = {**config(a, [a.rate_sweep_seq]), "trace": None, "megatron": None, "kinds": ["mlp"]}
        rate_runs = run_rates(rcfg, a.rate_sweep.split(","), a.burst)
    print(write(a, seq_runs, rate_runs, cmd))
    return 0


if __name__ == "__main__":
    sys.exit(main())
