"""Emulated two-level topology: all-reduce latency vs message size (the decode all-reduce), stock vs ring /
recursive doubling / hierarchical / hierarchical pipelined and `auto` (after its start-up calibration), with
inter-node traffic shaped and intra-node traffic not.

    sudo .venv/bin/python benchmarks/topology/run.py --layouts 4:2 8:2 --inter-rate 1gbit
    .venv/bin/python benchmarks/topology/run.py --render benchmarks/topology/data/two_level_raw.json  # tables again

How nodes, the htb tree and the source-binding shim are set up: benchmarks/harness/topology.py. Every rank
runs `python -m megatron_flashoverlap.tools.calibrate_allreduce`, so allreduce_topology_raw.json is also a
calibration table `all_reduce(algo="auto")` can read on that topology. Writes into --out:
allreduce_topology.md (a table per layout: benchmarks/topology/table.py), allreduce_topology_raw.json (the
calibration tables plus the bytes each htb class carried, which show that the inter-node traffic went through
the shaped classes) and allreduce_topology.png.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if __name__ == "__main__":  # run as a script: the checkout's root on the path, not this folder
    sys.path[0] = ROOT

from benchmarks.harness.cli import out_dir, parser, rerender  # noqa: E402
from benchmarks.harness.launch import command_line, write_text  # noqa: E402
from benchmarks.harness.netns import shaped_namespace, why_not_shaped  # noqa: E402
from benchmarks.harness.topology import add_nodes, build_shim, class_bytes, run_layout, shape_inter_node  # noqa: E402
from benchmarks.topology.table import markdown, plot  # noqa: E402

NEEDS = ("It needs root, iproute2 and gcc (a network namespace, htb on its loopback and an LD_PRELOAD shim built "
         "from benchmarks/harness/bind_source.c); there is no unshaped mode.")


def _args(argv=None):
    p = parser(__doc__, "topology", NEEDS)
    p.add_argument("--layouts", nargs="+", default=["4:2", "8:2"], help="world:ranks-per-node")
    p.add_argument("--inter-rate", default="1gbit", help="htb rate of each node's inter-node egress")
    p.add_argument("--burst", default="256kb")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--sizes", type=int, nargs="*", help="bytes (default 8 KB - 8 MB, x2)")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--out", default=out_dir("topology"), help="folder for the files above (default out/topology/)")
    p.add_argument("--render", metavar="RAW", help="rewrite the tables of the markdown beside RAW (X_raw.json -> "
                   "X.md) from its calibration tables (nothing is run; the title and command lines are kept)")
    return p.parse_args(argv)


def calibrate_argv(args, world: int, local: int, out_json: str) -> list[str]:
    note = (f"{world // local} nodes x {local} ranks, inter-node htb {args.inter_rate} per node, "
            f"intra-node unshaped loopback")
    argv = ["--out", out_json, "--dtype", args.dtype, "--iters", str(args.iters), "--note", note]
    return argv + (["--sizes", *map(str, args.sizes)] if args.sizes else [])


def body(raw: dict) -> str:
    """The sections of the markdown from the raw JSON ({"tables", "htb_bytes"}): what --render rebuilds."""
    return ("## Latency per message size\n\n" + markdown(raw["tables"]) + "\nbytes per htb class (1:<node+1> = "
            "shaped inter-node egress) and direct (unshaped) packets per layout: " + json.dumps(raw["htb_bytes"])
            + "\n")


def measure(args, layouts: list[tuple[int, int]], out_json: str) -> dict:
    """Every layout once in one namespace; -> {layout: bytes per htb class}."""
    counters = {}
    with tempfile.TemporaryDirectory() as tmp, shaped_namespace(None) as ns:
        shim = build_shim(tmp)
        add_nodes(ns, max(w // g for w, g in layouts))
        for world, local in layouts:
            shape_inter_node(ns, world // local, args.inter_rate, args.burst)
            run_layout(ns, world, local, calibrate_argv(args, world, local, out_json), shim, args.timeout)
            counters[f"{world}:{local}"] = class_bytes(ns)
    return counters


def main(argv=None) -> None:
    args = _args(argv)
    if args.render:
        rerender(args.render, body, "topology/run.py")
        return
    if why_not_shaped():
        raise SystemExit(f"topology benchmark: {why_not_shaped()}")
    os.makedirs(args.out, exist_ok=True)
    out_json = os.path.abspath(os.path.join(args.out, "allreduce_topology_raw.json"))
    layouts = [tuple(map(int, s.split(":"))) for s in args.layouts]
    counters = measure(args, layouts, out_json)
    with open(out_json) as f:
        tables = [t for t in json.load(f)["tables"] if (t["world_size"], t["local_world_size"]) in layouts]
    raw = {"tables": tables, "htb_bytes": counters}
    with open(out_json, "w") as f:
        json.dump(raw, f, indent=1)
    head = ["# Two-level topology: the decode all-reduce", "",
            f"Command: `{command_line('topology/run.py', argv)}`", ""]
    write_text(os.path.join(args.out, "allreduce_topology.md"), "\n".join(head) + "\n" + body(raw))
    plot(tables, os.path.join(args.out, "allreduce_topology.png"))


if __name__ == "__main__":
    main()
