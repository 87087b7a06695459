"""Emulated two-level topology (benchmarks/topology/run.py, benchmarks/dp/run.py --topology nodes): nodes as
loopback addresses, htb per node.

One network namespace (benchmarks/harness/netns.py) holds one loopback address per node, 127.0.1.<node+1> (label
lo:<node+1>). lo's root qdisc is htb: each node has one class (its "NIC") at the inter-node rate, and a u32
filter per ordered pair of distinct nodes (match ip src node a, dst node b) sends a -> b traffic into a's
class. Everything else (same-node pairs, the TCP store on 127.0.0.1) matches no filter and takes htb's
direct queue, unshaped. No delay is added: this kernel has no netem.

Ranks bind to their node's address: GLOO_SOCKET_IFNAME=lo:<node+1> puts gloo's listener there, and gloo
connects without binding a source (checked with `ss -tn`: both ends showed the listener's address), so an
LD_PRELOAD shim (benchmarks/harness/bind_source.c, built with gcc) binds each outgoing connection to the address
in BIND_SOURCE_ADDR. Both are set per rank by `run_ranks(rank_env=...)` before any process group exists.
run_layout: every rank runs `python -m megatron_flashoverlap.tools.calibrate_allreduce`, so the JSON written is
also a calibration table for `all_reduce(algo="auto")` on that topology.
"""
from __future__ import annotations

import os
import re
import subprocess

from benchmarks.harness.launch import ROOT, run_ranks

SHIM_SOURCE = os.path.join(ROOT, "benchmarks", "harness", "bind_source.c")
SOURCE_ENV = "BIND_SOURCE_ADDR"  # read by the shim at every connect(); not a project setting


def node_addr(node: int) -> str:
    return f"127.0.1.{node + 1}"


def build_shim(workdir: str) -> str:
    """gcc the LD_PRELOAD shim into workdir; -> the .so path."""
    lib = os.path.join(workdir, "bind_source.so")
    subprocess.run(["gcc", "-shared", "-fPIC", "-O2", "-o", lib, SHIM_SOURCE, "-ldl"], check=True, timeout=120)
    return lib


def add_nodes(ns, nodes: int) -> None:
    for node in range(nodes):
        ns.ip("addr", "add", f"{node_addr(node)}/32", "dev", "lo", "label", f"lo:{node + 1}")


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


def node_env(local: int):
    """rank -> the env that binds its gloo sockets to its node's address (node = rank // local)."""
    def env(rank: int) -> dict:
        node = rank // local
        return {"GLOO_SOCKET_IFNAME": f"lo:{node + 1}", SOURCE_ENV: node_addr(node)}
    return env


def rank_env(local: int):
    """rank -> LOCAL_RANK, LOCAL_WORLD_SIZE of its emulated node (`local` ranks each) and node_env."""
    def env(rank: int) -> dict:
        return {"LOCAL_RANK": str(rank % local), "LOCAL_WORLD_SIZE": str(local), **node_env(local)(rank)}
    return env


def run_layout(ns, world: int, local: int, calibrate_argv: list[str], shim: str, timeout: float) -> None:
    """All ranks of one layout, each `calibrate_allreduce calibrate_argv` bound to its node address."""
    target = ["megatron_flashoverlap.tools.calibrate_allreduce", "--local-world-size", str(local), *calibrate_argv]
    run_ranks(target, world, ns=ns, env={"LD_PRELOAD": shim}, rank_env=rank_env(local), timeout=timeout)
