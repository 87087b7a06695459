"""Emulated two-level topology: all-reduce latency vs message size, stock vs ring / recursive doubling /
hierarchical, with inter-node traffic shaped and intra-node traffic not.

    sudo .venv/bin/python benchmarks/topology.py --layouts 4:2 8:2 --inter-rate 1gbit --out results/

One network namespace (megatron_flashoverlap.bench.netns) holds one loopback address per node,
127.0.1.<node+1> (label lo:<node+1>). lo's root qdisc is htb: each node has one class (its "NIC") at
`--inter-rate`, and a u32 filter per ordered pair of distinct nodes (match ip src node a, dst node b)
sends a -> b traffic into a's class. Everything else (same-node pairs, the TCP store) matches no filter
and takes htb's direct queue, unshaped. No delay is added: this kernel has no netem.

Ranks bind to their node's address: GLOO_SOCKET_IFNAME=lo:<node+1> puts gloo's listener there, and
gloo connects without binding a source (checked with `ss -tn`: both ends showed the listener's address),
so an LD_PRELOAD shim (benchmarks/bind_source.c, built here with gcc) binds each outgoing connection to
the rank's node address. The per-class byte counters printed at the end show the inter-node traffic
went through the shaped classes. Every rank runs `python -m megatron_flashoverlap.bench.calibrate_allreduce`,
so the JSON written here is also a calibration table for `all_reduce(algo="auto")` on that topology.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_flashoverlap.bench.netns import shaped_namespace, why_not_shaped  # noqa: E402

ALGOS = ("stock", "ring", "recursive_doubling", "hierarchical")


def node_addr(node: int) -> str:
    return f"127.0.1.{node + 1}"


def build_shim(workdir: str) -> str:
    src, lib = os.path.join(ROOT, "benchmarks", "bind_source.c"), os.path.join(workdir, "bind_source.so")
    subprocess.run(["gcc", "-shared", "-fPIC", "-O2", "-o", lib, src, "-ldl"], check=True, timeout=120)
    return lib


def shape_inter_node(ns, nodes: int, rate: str, burst: str) -> None:
    """htb on lo: class 1:<a+1> per node at `rate`; filters put a -> b (a != b) into a's class."""
    try:  # a fresh tree per layout
        ns.tc("qdisc", "del", "dev", "lo", "root")
    except subprocess.CalledProcessError:
        pass
    ns.tc("qdisc", "add", "dev", "lo", "root", "handle", "1:", "htb", "default", "999")
    for a in range(nodes):
        ns.tc("class", "add", "dev", "lo", "parent", "1:", "classid", f"1:{a + 1}", "htb", "rate", rate,
              "ceil", rate, "burst", burst, "cburst", burst, "quantum", "65536")
        for b in range(nodes):
            if a != b:
                ns.tc("filter", "add", "dev", "lo", "parent", "1:", "protocol", "ip", "prio", "1", "u32",
                      "match", "ip", "src", f"{node_addr(a)}/32", "match", "ip", "dst", f"{node_addr(b)}/32",
                      "flowid", f"1:{a + 1}")


def class_bytes(ns) -> dict:
    """Bytes sent per htb class and through the direct (unshaped) queue."""
    text = ns.tc("-s", "class", "show", "dev", "lo")
    out = {m.group(1): int(m.group(2)) for m in re.finditer(r"class htb (1:\d+) .*?\n\s*Sent (\d+) bytes", text)}
    q = ns.tc("-s", "qdisc", "show", "dev", "lo")
    out["direct_packets"] = int(re.search(r"direct_packets_stat (\d+)", q).group(1))
    return out


def _rank_env(rank, world, local, port, shim) -> dict:
    node = rank // local
    return {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank % local),
            "LOCAL_WORLD_SIZE": str(local), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "GLOO_SOCKET_IFNAME": f"lo:{node + 1}", "FLASHOVERLAP_SOURCE_ADDR": node_addr(node),
            "LD_PRELOAD": shim, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT, "PYTHONWARNINGS": "ignore",
            "TORCH_CPP_LOG_LEVEL": "ERROR"}


def run_layout(ns, world, local, args, shim, out_json) -> None:
    """All ranks of one layout, each `calibrate_allreduce` bound to its node address."""
    argv = [sys.executable, "-m", "megatron_flashoverlap.bench.calibrate_allreduce", "--out", out_json,
            "--local-world-size", str(local), "--dtype", args.dtype, "--iters", str(args.iters),
            "--note", f"{world // local} nodes x {local} ranks, inter-node htb {args.inter_rate} per node, "
                      f"intra-node unshaped loopback, host load average {os.getloadavg()[0]:.1f} at start"]
    if args.sizes:
        argv += ["--sizes", *map(str, args.sizes)]
    port = 29700 + world * 10 + local
    procs = [ns.popen(argv, env=_rank_env(r, world, local, port, shim), stdout=subprocess.DEVNULL)
             for r in range(world)]
    try:
        rcs = [p.wait(timeout=args.timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if any(rcs):
        raise RuntimeError(f"layout {world}:{local}: ranks exited with {rcs}")


def _fmt_bytes(n: int) -> str:
    return f"{n >> 20} MB" if n >= 1 << 20 else f"{n >> 10} KB"


def markdown(tables: list[dict]) -> str:
    lines = []
    for t in tables:
        lines += [f"**{t['world_size']} ranks = {t['world_size'] // t['local_world_size']} nodes x "
                  f"{t['local_world_size']}** ({t['dtype']}, median of {t['iters']} rounds, ms; {t['note']}; "
                  f"{t['measured_at']})", "",
                  "| size | stock | ring | recursive doubling | hierarchical | best ours | speedup vs stock |",
                  "|---|---|---|---|---|---|---|"]
        for r in t["rows"]:
            ours = {a: r[f"{a}_us"] for a in ALGOS[1:]}
            best = min(ours, key=ours.get)
            cells = " | ".join(f"{r[f'{a}_us'] / 1e3:.2f}" for a in ALGOS)
            lines.append(f"| {_fmt_bytes(r['bytes'])} | {cells} | {best} | {r['stock_us'] / ours[best]:.2f}x |")
        lines.append("")
    return "\n".join(lines)


def plot(tables: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(tables), figsize=(6 * len(tables), 4.5), squeeze=False)
    for ax, t in zip(axes[0], tables):
        xs = [r["bytes"] for r in t["rows"]]
        for a in ALGOS:
            ax.plot(xs, [r[f"{a}_us"] / 1e3 for r in t["rows"]], marker="o", label=a)
        ax.set(xscale="log", yscale="log", xlabel="message size (bytes)", ylabel="latency (ms, median)",
               title=f"{t['world_size']} ranks: {t['world_size'] // t['local_world_size']} nodes x "
                     f"{t['local_world_size']}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


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
        for node in range(max(w // g for w, g in layouts)):
            ns.ip("addr", "add", f"{node_addr(node)}/32", "dev", "lo", "label", f"lo:{node + 1}")
        for world, local in layouts:
            shape_inter_node(ns, world // local, args.inter_rate, args.burst)
            run_layout(ns, world, local, args, shim, out_json)
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
