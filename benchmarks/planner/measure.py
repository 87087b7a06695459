"""The calibration runs (calibrate.py on every rank) and where they run: host loopback for compute, one tbf
namespace per rate, an unshaped namespace and a two-node htb namespace for the topology's links.

    calibrate(rounds, rates, timeout) -> {"compute_<P>", "link_<rate>_<P>", "link_unshaped_2", "link_htb_<P>"}
Links are measured on every group size a table uses (tbf: P = 2 at every rate, P = 4 at the MoE's rates;
htb: the topology's layouts, 2 ranks per node): the per-step host cost grows with processes per core.
"""
from __future__ import annotations

import sys
import tempfile

from benchmarks.harness.launch import run_ranks
from benchmarks.harness.netns import parse_rate, shaped_namespace
from benchmarks.harness.topology import add_nodes, build_shim, node_env, shape_inter_node
from benchmarks.planner import settings as S
from benchmarks.planner.predict import shapes

TARGET = "benchmarks.planner.calibrate:main"
ADDS = (10_000, 100_000, 1_000_000, 4_000_000)
TBF_SIZES = (4096, 65536, 1 << 20, 4 << 20)
TOPO_SIZES = (1024, 16384, 262144, 2 << 20)
SLOW_GEMM = (1024, 1024, 1024)
HTB_BURST = "256kb"  # benchmarks/topology/run.py's default


def rank0(world: int, cfg: dict, ns=None, timeout: float = 3600.0, target: str = TARGET, **kw) -> dict:
    """Rank 0's figures; a run whose ranks failed is run once more, said on stderr (a rank has aborted at exit,
    "terminate called without an active exception", in 2 of about 30 runs: not diagnosed)."""
    try:
        return run_ranks(target, world, args=(cfg,), ns=ns, timeout=timeout, **kw)[0]
    except RuntimeError as err:
        print(f"run of {target} failed, running it once more: {err}", file=sys.stderr)
    return run_ranks(target, world, args=(cfg,), ns=ns, timeout=timeout, **kw)[0]


def slow_bytes(rate: str) -> int:
    """About 60 ms of the link at `rate` (each direction gets half of a tbf on lo)."""
    return int(parse_rate(rate) / 8 / 2 * 0.06) // 4 * 4


def calibrate(rounds: int, rates=S.RATES, timeout: float = 3600.0, log=print) -> dict:
    need, out = shapes(), {}
    for world in (2, 4):
        log(f"compute, {world} ranks: {len(need[f'gemm_{world}'])} GEMM shapes")
        cfg = {"rounds": rounds, "gemm": need[f"gemm_{world}"], "add": ADDS,
               "gelu": need["gelu"] if world == 2 else []}
        out[f"compute_{world}"] = rank0(world, cfg, timeout=timeout)
    for rate in rates:
        for world in (2, 4) if rate in {r for _, r in S.MOE["points"]} else (2,):
            log(f"link, tbf {rate}, {world} ranks")
            with shaped_namespace(rate) as ns:
                cfg = {"rounds": rounds, "link": TBF_SIZES,
                       "slowdown": [SLOW_GEMM, slow_bytes(rate)] if world == 2 else None}
                out[f"link_{rate}_{world}"] = rank0(world, cfg, ns, timeout)
    log("link, unshaped namespace loopback, 2 ranks")
    with shaped_namespace(None) as ns:
        out["link_unshaped_2"] = rank0(2, {"rounds": rounds, "link": TOPO_SIZES}, ns, timeout)
    with shaped_namespace(None) as ns, tempfile.TemporaryDirectory() as tmp:
        shim = build_shim(tmp)
        nodes = max(p // local for p, local in S.TOPOLOGY["layouts"])
        add_nodes(ns, nodes)
        for world, local in S.TOPOLOGY["layouts"]:
            log(f"link, htb {S.TOPOLOGY['rate']} per node, {world} ranks, {local} per node")
            shape_inter_node(ns, world // local, S.TOPOLOGY["rate"], HTB_BURST)
            out[f"link_htb_{world}"] = rank0(world, {"rounds": rounds, "link": TOPO_SIZES}, ns, timeout,
                                              env={"LD_PRELOAD": shim}, rank_env=node_env(local))
    return out


__all__ = ["calibrate"]
