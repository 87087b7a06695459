"""DP gradient reduce-scatter vs Megatron's `--overlap-grad-reduce`, on the emulated link (ranks in a
tbf-shaped network namespace; the bench harness's netns, rounds and estimator).

    sudo .venv/bin/python benchmarks/dp/run.py                  # GPT rows -> out/dp/dp.md (+ dp_raw.json)
    .venv/bin/python benchmarks/dp/run.py --unshaped --quick    # no root: host loopback, labelled
    sudo .venv/bin/python benchmarks/dp/run.py --ops            # the earlier operator rows
    .venv/bin/python benchmarks/dp/run.py --render benchmarks/dp/data/link_bound_raw.json   # tables again

GPT rows (default): a Megatron GPT (--layers >= 4) under DDP + DistributedOptimizer, overlap_grad_reduce on,
one training step per arm and round (benchmarks/dp/gpt.py: arms, what `step`, `free` and `tail` measure),
for every --layouts entry TPxDP (4 ranks for 2x2, 2 for 1x2). --ops: the operator rows
(benchmarks/dp/ops_rows.py).

--topology: `shared` (default) one tbf on lo at the rate, which every rank's traffic shares, TP's and DP's in both
directions; `nodes` a node per TP group (benchmarks/harness/topology.py: an address per node, htb egress per
node at the rate into every other node, traffic inside a node unshaped, an LD_PRELOAD shim binding each rank's
sockets), so DP's rings cross the shaped links and TP's stay inside the node, as TP on NVLink and DP over the
network do.
"""
from __future__ import annotations

import datetime
import os
import statistics
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if __name__ == "__main__":  # run as a script: the checkout's root on the path, not this folder
    sys.path[0] = ROOT

from benchmarks.dp import table as dp_gpt_table  # noqa: E402
from benchmarks.dp.gpt import check_arms  # noqa: E402
from benchmarks.dp.ops_rows import summary as ops_summary, table  # noqa: E402
from benchmarks.harness.cli import RENDERED, before_run, out_dir, parser  # noqa: E402,F401  (RENDERED: the note)
from benchmarks.harness.launch import STOCK_RS_LABEL, add_stock_rs_arg, command_line, run_ranks, write_results  # noqa: E402
from benchmarks.harness.netns import shaped_namespace  # noqa: E402
from benchmarks.harness.topology import add_nodes, build_shim, class_bytes, node_env, shape_inter_node  # noqa: E402

TOPOLOGY = {"shared": "one tbf link shared by all traffic",
            "nodes": "a node per TP group, htb egress per node between nodes, unshaped inside a node"}

RANKS = "benchmarks.dp.ops_rows:main"
GPT_RANKS = "benchmarks.dp.gpt:main"


def parse(argv=None):
    p = parser(__doc__, "dp")
    p.add_argument("--rates", default="1gbit", help="tbf rates (comma list)")
    p.add_argument("--burst", default="512kb")
    p.add_argument("--topology", choices=("shared", "nodes"), default="shared", help="GPT rows: one shaped link "
                   "for all traffic, or a node per TP group with shaped links between nodes (module docstring)")
    p.add_argument("--ops", action="store_true", help="the operator rows instead of the GPT rows")
    p.add_argument("--layouts", default="2x2,1x2", help="GPT rows: TPxDP entries (comma list)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=1024, help="GPT rows: untied, small (the embedding stays small)")
    p.add_argument("--seq", type=int, default=512, help="GPT rows: sequence length")
    p.add_argument("--bucket", type=int, default=0, help="GPT rows: the small bucket size in elements "
                   "(0: one transformer layer's weights per TP rank, 12 h^2 / tp)")
    p.add_argument("--seqs", default="512,1024", help="--ops: TP-without-SP sequence lengths")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--width", type=int, default=512, help="--ops: per-rank inner width of the TP MLP")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dp-n", type=int, default=1024, help="--ops: DP weight rows (W [n, k])")
    p.add_argument("--dp-k", type=int, default=512)
    p.add_argument("--dp-tokens", type=int, default=2048, help="--ops: tokens of the wgrad GEMM")
    p.add_argument("--ddp-layers", type=int, default=2, help="--ops: column+row blocks of the Megatron DDP rows")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--arms", default="", help="GPT rows: a subset of the arms, ';'-separated names "
                   "from benchmarks/dp/gpt.py ARMS (they contain commas), 'stock' among them; default all")
    add_stock_rs_arg(p)
    p.add_argument("--unshaped", action="store_true", help="host loopback, no root; labelled 'unshaped'")
    p.add_argument("--quick", action="store_true", help="tiny sizes, 1 repeat (smoke test)")
    p.add_argument("--out", default=out_dir("dp"), help="folder for dp.md and dp_raw.json (default out/dp/)")
    p.add_argument("--timeout", type=float, default=3600.0)
    p.add_argument("--render", metavar="RAW", help="GPT rows: rewrite the tables and verdicts of the markdown beside "
                   "RAW (X_raw.json -> X.md) from its samples (nothing is run; the title and command lines are kept)")
    a = p.parse_args(argv)
    if a.quick:
        a.seqs, a.hidden, a.width, a.dp_n, a.dp_k, a.dp_tokens, a.repeats = "64", 64, 64, 64, 64, 64, 1
        a.seq, a.heads, a.vocab = 64, 4, 128
    if a.topology == "nodes" and (a.unshaped or a.ops):
        p.error("--topology nodes shapes the links between nodes: it needs the GPT rows on a shaped link (drop "
                "--unshaped / --ops)")
    a.arm_list = check_arms([n.strip() for n in a.arms.split(";")]) if a.arms else ()
    return a


def _layouts(s: str) -> list[tuple[int, int]]:
    out = []
    for item in s.split(","):
        tp, _, dp = item.partition("x")
        if not (tp.isdigit() and dp.isdigit()) or int(dp) < 2:
            raise ValueError(f"--layouts {item!r}: write TPxDP with DP >= 2, e.g. 2x2 or 1x2")
        out.append((int(tp), int(dp)))
    return out


def gpt_cfg(a, tp: int) -> dict:
    bucket = a.bucket or 12 * a.hidden * a.hidden // tp
    return {"tp": tp, "layers": a.layers, "hidden": a.hidden, "heads": a.heads, "vocab": a.vocab, "seq": a.seq,
            "batch": a.batch, "bucket": bucket, "repeats": a.repeats, "stock_rs": a.stock_rs,
            **({"arms": list(a.arm_list)} if a.arm_list else {})}


def _jobs(a) -> list[tuple[str, int, dict]]:
    """(target, world, cfg) of every run on one link."""
    if a.ops:
        cfg = {"seqs": [int(s) for s in a.seqs.split(",")], "hidden": a.hidden, "width": a.width,
               "batch": a.batch, "dp_n": a.dp_n, "dp_k": a.dp_k, "dp_tokens": a.dp_tokens,
               "ddp_layers": a.ddp_layers, "repeats": a.repeats, "burst": a.burst, "stock_rs": a.stock_rs}
        return [(RANKS, 2, cfg)]
    return [(GPT_RANKS, tp * dp, gpt_cfg(a, tp)) for tp, dp in _layouts(a.layouts)]


def runs(a) -> list[dict]:
    """Every job once per rate in one shaped namespace (or once on the host loopback)."""
    out = []
    nodes = a.topology == "nodes"
    with (shaped_namespace(None) if not a.unshaped else _null()) as ns, \
            (tempfile.TemporaryDirectory() if nodes else _null()) as tmp:  # the shim's build directory
        shim = build_shim(tmp) if nodes else None
        if nodes:
            add_nodes(ns, max(dp for _, dp in _layouts(a.layouts)))
        for rate in (["unshaped (host loopback)"] if a.unshaped else a.rates.split(",")):
            if ns is not None and not nodes:
                ns.shape_lo(rate, a.burst)
            for target, world, cfg in _jobs(a):
                kw = {}
                if nodes:
                    shape_inter_node(ns, world // cfg["tp"], rate, a.burst)
                    kw = {"env": {"LD_PRELOAD": shim}, "rank_env": node_env(cfg["tp"])}
                res = run_ranks(target, world, args=(cfg,), ns=ns, timeout=a.timeout, **kw)[0]
                link = TOPOLOGY[a.topology] if ns is not None else "host loopback"
                out.append({**res, "rate": rate, "topology": link, **({"class_bytes": class_bytes(ns)} if nodes else {})})
    return out


def _null():
    import contextlib
    return contextlib.nullcontext(None)


def _stock_rs(run: dict) -> str:
    """How the run's reduce-scatters outside our rings moved (runs before --stock-rs used gloo's own)."""
    calls = run.get("line_rate_calls")
    if run["config"].get("stock_rs", "gloo") == "gloo" or calls is None:
        return STOCK_RS_LABEL["gloo"]
    return f"{STOCK_RS_LABEL['ring']}; rank 0: {calls['dp_bucket']} DP-bucket and {calls['other']} other calls"


def _topology(run: dict) -> str:
    """The run's link (runs before --topology recorded none: the host loopback unshaped, else one shared tbf)."""
    default = "host loopback" if run["rate"].startswith("unshaped") else TOPOLOGY["shared"]
    return run.get("topology", default)


def _class_bytes(run: dict) -> str:
    """' (MB through each node's shaped egress / unshaped packets)' where the run counted them."""
    counts = run.get("class_bytes")
    if not counts:
        return ""
    shaped = ", ".join(f"{k} {v / 1e6:.0f} MB" for k, v in sorted(counts.items()) if k.startswith("1:"))
    return f" (shaped egress: {shaped}; unshaped: {counts['direct_packets']} packets)"


def _host(run: dict) -> str:
    """', its CPU time ...' where the run recorded it (benchmarks/dp/table.py host_floor)."""
    floor = dp_gpt_table.host_floor(run)
    if floor is None:
        return ""
    cpu = statistics.median(run["comm_cpu"])
    return (f", its CPU time (every thread, summed over the ranks) {cpu * 1e3:.0f} ms: about {floor * 1e3:.0f} ms "
            f"of a step on {run['cores']} busy cores however well it is overlapped (the host floor)")


def _gpt_md(results: list[dict]) -> list[str]:
    md, verdicts = [], []
    for run in results:
        c = run["config"]
        label = f"{run['rate']}, TP{c['tp']}xDP{run['dp']}"
        md += [f"## link {label} ({run['world']} ranks on {run.get('cores', os.cpu_count())} cores): GPT {c['layers']} layers, h={c['hidden']}, ffn={4 * c['hidden']}, "
               f"heads={c['heads']}, s={c['seq']}, b={c['batch']}, vocab={c['vocab']} untied, fp32, "
               f"small buckets {c['bucket']} elements, {c['repeats']} rounds; {_stock_rs(run)}; "
               f"{_topology(run)}{_class_bytes(run)}", "",
               dp_gpt_table.table(run), "", f"DP communication alone (every bucket's reduce-scatter, stock): "
               f"{statistics.median(run['comm']) * 1e3:.0f} ms{_host(run)}. Automatic choice: "
               + "; ".join(line for line in run["log"] if "automatic" in line), ""]
        verdicts += dp_gpt_table.verdict(run, label)
    return ["## Verdict (90 % bootstrap intervals over rounds)", ""] + verdicts + [""] + md


def _ops_md(results: list[dict]) -> list[str]:
    md = []
    for run in results:
        c = run["config"]
        md += [f"## link {run['rate']}, 2 ranks, W [{c['dp_n']}, {c['dp_k']}] fp32, TP MLP h={c['hidden']} "
               f"w={c['width']} b={c['batch']}; {STOCK_RS_LABEL[c['stock_rs']]}", "",
               "Summary (a win or loss only where the 90 % interval excludes 1.0):", ""] + ops_summary(run) + [
               "", table(run), ""]
    return md


def body(results: list[dict]) -> str:
    """The sections of dp.md from its samples (dp_raw.json; the operator rows' when the runs hold them): what
    --render rebuilds."""
    ops = bool(results) and "seqs" in results[0]["config"]
    return "\n".join(_ops_md(results) if ops else _gpt_md(results)) + "\n"


def main(argv=None) -> int:
    a = parse(argv)
    if (code := before_run(a, body, "dp/run.py")) is not None:
        return code
    results = runs(a)
    cmd = command_line("dp/run.py", argv)
    title = "DP reduce-scatter in the wgrad GEMM vs --overlap-grad-reduce" + (", operator rows" if a.ops else "")
    md = [f"# {title} ({datetime.date.today()})", "", f"Command: `{cmd}`", ""]
    md += _ops_md(results) if a.ops else _gpt_md(results)
    write_results(a.out, "dp", "\n".join(md) + "\n", results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
