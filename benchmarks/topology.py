"""Emulated two-level topology: all-reduce latency vs message size, stock vs ring / recursive doubling /
hierarchical, with inter-node traffic shaped and intra-node traffic not.

    sudo .venv/bin/python benchmarks/topology.py --layouts 4:2 8:2 --inter-rate 1gbit --out results/

How nodes, the htb tree and the source-binding shim are set up: megatron_flashoverlap/bench/topology.py.
The per-class byte counters printed at the end show the inter-node traffic went through the shaped classes.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_flashoverlap.bench.netns import shaped_namespace, why_not_shaped  # noqa: E402
from megatron_flashoverlap.bench.topology import (add_nodes, build_shim, class_bytes, markdown, plot,  # noqa: E402
                                                  run_layout, shape_inter_node)


def _args(argv=None):
    p = argparse.ArgumentParser(description="two-level topology all-reduce benchmark (needs root)")
    p.add_argument("--layouts", nargs="+", default=["4:2", "8:2"], help="world:ranks-per-node")
    p.add_argument("--inter-rate", default="1gbit", help="htb rate of each node's inter-node egress")
    p.add_argument("--burst", default="256kb")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--sizes", type=int, nargs="*", help="bytes (default 8 KB - 8 MB, x2)")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--out", default="results")
    return p.parse_args(argv)


def calibrate_argv(args, world: int, local: int, out_json: str) -> list[str]:
    note = (f"{world // local} nodes x {local} ranks, inter-node htb {args.inter_rate} per node, "
            f"intra-node unshaped loopback, host load average {os.getloadavg()[0]:.1f} at start")
    argv = ["--out", out_json, "--dtype", args.dtype, "--iters", str(args.iters), "--note", note]
    return argv + (["--sizes", *map(str, args.sizes)] if args.sizes else [])


def main(argv=None) -> None:
    args = _args(argv)
    if why_not_shaped():
        raise SystemExit(f"topology benchmark: {why_not_shaped()}")
    os.makedirs(args.out, exist_ok=True)
    out_json = os.path.abspath(os.path.join(args.out, "allreduce_topology.json"))
    layouts = [tuple(map(int, s.split(":"))) for s in args.layouts]
    counters = {}
    with tempfile.TemporaryDirectory() as tmp, shaped_namespace(None) as ns:
        shim = build_shim(tmp)
        add_nodes(ns, max(w // g for w, g in layouts))
        for world, local in layouts:
            shape_inter_node(ns, world // local, args.inter_rate, args.burst)
            run_layout(ns, world, local, calibrate_argv(args, world, local, out_json), shim, args.timeout)
            counters[f"{world}:{local}"] = class_bytes(ns)
    with open(out_json) as f:
        tables = [t for t in json.load(f)["tables"] if (t["world_size"], t["local_world_size"]) in layouts]
    text = markdown(tables) + "\nbytes per htb class (1:<node+1> = shaped inter-node egress) and direct " \
                              "(unshaped) packets per layout: " + json.dumps(counters) + "\n"
    with open(os.path.join(args.out, "allreduce_topology.md"), "w") as f:
        f.write(text)
    plot(tables, os.path.join(args.out, "allreduce_topology.png"))
    print(text)


if __name__ == "__main__":
    main()
