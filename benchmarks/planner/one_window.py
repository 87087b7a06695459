"""The one-window run's host side (run.py --one-window): every window of settings.WINDOWS launched once on its
own link, rank side benchmarks/planner/window.py (probe, point, probe, point, ..., probe).

    one_window(rounds, passes, timeout, log) -> {"rounds", "passes", "seconds", "windows": [...]}
        a window: {"name", "link", "rate", "world", "gpus_per_node", "seconds", "calibrations", "points"}
    tbf windows: one namespace with tbf on lo (every rank on one shaped queue, one node); the htb window: one
    loopback address per node, htb per node's egress, intra-node unshaped (benchmarks/harness/topology.py)
"""
from __future__ import annotations

import tempfile
import time

from benchmarks.harness.netns import shaped_namespace
from benchmarks.harness.topology import add_nodes, build_shim, node_env, shape_inter_node
from benchmarks.planner import settings as S
from benchmarks.planner.measure import rank0, slow_bytes
from benchmarks.planner.window_predict import probe_config

TARGET = "benchmarks.planner.window:main"


def window_config(spec: tuple, rounds: int, passes: int) -> tuple[dict, int]:
    """(window.py's cfg, ranks per node) of one settings.WINDOWS entry."""
    _, link, rate, world, points, sizes = spec
    local = S.WINDOW_AR["local"] if link == "htb" else world
    probe = probe_config(points, world, sizes, slow_bytes(rate) if link == "tbf" else None)
    return {"gpus_per_node": local, "rounds": rounds, "passes": passes, "points": list(points), "probe": probe}, local


def run_window(spec: tuple, rounds: int, passes: int, timeout: float) -> dict:
    name, link, rate, world, _, _ = spec
    cfg, local = window_config(spec, rounds, passes)
    t0 = time.monotonic()
    if link == "tbf":
        with shaped_namespace(rate, burst=S.BURST) as ns:
            res = rank0(world, cfg, ns, timeout, TARGET)
    else:
        with shaped_namespace(None) as ns, tempfile.TemporaryDirectory() as tmp:
            shim = build_shim(tmp)
            add_nodes(ns, world // local)
            shape_inter_node(ns, world // local, rate, S.BURST)
            res = rank0(world, cfg, ns, timeout, TARGET, env={"LD_PRELOAD": shim}, rank_env=node_env(local))
    return {"name": name, "link": link, "rate": rate, "world": world, "gpus_per_node": local,
            "seconds": round(time.monotonic() - t0, 1), **res}


def one_window(rounds: int, passes: int, timeout: float, log=print, only=None) -> dict:
    """Every window (`only`: the names to run, None: all) in settings order (module docstring)."""
    t0, windows = time.monotonic(), []
    for spec in S.WINDOWS:
        if only and spec[0] not in only:
            continue
        log(f"window {spec[0]}: {spec[3]} ranks, {len(spec[4])} point(s) x {passes} pass(es), {rounds} rounds")
        windows.append(run_window(spec, rounds, passes, timeout))
    return {"rounds": rounds, "passes": passes, "seconds": round(time.monotonic() - t0, 1), "windows": windows}
