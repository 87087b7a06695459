"""The CPU proxy's scheduling, measured: what the host's scheduler does to gloo's transport threads, and how the
one-window prices read once those threads run before the compute.

    nice -n -10 python benchmarks/planner/scheduling.py                  # as root: 2 ranks, about 100 s
    python benchmarks/planner/scheduling.py --render benchmarks/planner/data/scheduling.json   # the tables again

Part 1, one transfer (the namespace's unshaped loopback, and tbf RATE with the windows' 80 kb bucket): gloo's
all-gather of BYTES per rank, and the same bytes exchanged both ways over one plain TCP socket between the two
ranks (Python's socket module: a sender thread and a receiving loop, no gloo), each timed after a barrier, the
variants interleaved over ROUNDS rounds, the max over the ranks. Three launches per link, the ranks' threads:
    default   the kernel's default policy (SCHED_OTHER), as every benchmark runs
    rr        every thread of the rank SCHED_RR at one real-time priority
    batch     every thread of the rank SCHED_BATCH (no wake-up preemption)
Part 2, the one-window run's TP + SP MLP block (settings.WINDOW_MLP: every method, fwd and fwd+bwd) at tbf RATE:
a calibration of the chooser's probe (window.py), the block's ROUNDS rounds, a calibration again, priced from the
two calibrations as the one-window run prices a point (window_predict, score.errors). Three launches, the policy
set during the block's rounds only (the calibrations run under the default one):
    default      as the one-window run
    rr           every thread of the rank SCHED_RR at one priority
    comm first   every thread of the rank but the one that computes at SCHED_FIFO
                 priority 2, the computing thread at SCHED_FIFO 1 (a transport thread runs as soon as it wakes,
                 as a GPU's copy engines and communication kernels progress beside a GEMM)
    A launch that does not finish in --timeout seconds is reported as such: with the transport first, gloo's
    loop thread can retry a lock without blocking while the thread that holds it waits, preempted, for a core
    (a livelock; benchmarks/planner/RESULTS.md).
A round "stalled" is one more than 1.5 ms over the variant's median.
"""
from __future__ import annotations

import json
import os
import socket
import statistics
import sys
import threading

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if __name__ == "__main__":  # run as a script: the checkout's root on the path, not this folder
    sys.path[0] = ROOT

STALL_S = 1.5e-3
POLICIES = ("default", "rr", "batch")
ARMS = ("default", "rr", "comm first")


# ---- rank side ---------------------------------------------------------------------------------------------

def _threads() -> list[int]:
    return [int(t) for t in os.listdir("/proc/self/task")]


def set_policy(policy: str) -> None:
    """Every thread of this process under `policy` (module docstring): "default" (SCHED_OTHER), "rr" (SCHED_RR 1),
    "batch" (SCHED_BATCH), "comm first" (every thread but the calling one SCHED_FIFO 2, the calling one
    SCHED_FIFO 1); threads made later inherit the policy of the thread that makes them."""
    me = threading.get_native_id()
    for tid in _threads():
        if policy == "comm first":
            kind, prio = os.SCHED_FIFO, 1 if tid == me else 2
        else:
            kind, prio = {"default": (os.SCHED_OTHER, 0), "rr": (os.SCHED_RR, 1), "batch": (os.SCHED_BATCH, 0)}[policy]
        os.sched_setscheduler(tid, kind, os.sched_param(prio))


def _socket_pair(rank: int) -> socket.socket:
    """One TCP connection between rank 0 and rank 1 of the default group, inside the ranks' namespace."""
    import torch.distributed as dist

    port = [None]
    if rank == 0:
        srv = socket.socket()
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        port[0] = srv.getsockname()[1]
    dist.broadcast_object_list(port, src=0)
    if rank == 0:
        conn, _ = srv.accept()
        srv.close()
    else:
        conn = socket.create_connection(("127.0.0.1", port[0]))
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return conn


def _exchange(conn: socket.socket, data: bytes, buf: memoryview) -> None:
    sender = threading.Thread(target=conn.sendall, args=(data,))
    sender.start()
    got = 0
    while got < len(buf):
        got += conn.recv_into(buf[got:], len(buf) - got)
    sender.join()


def transfer_rank(rank: int, world: int, cfg: dict) -> dict | None:
    """Part 1 on one link and policy: {variant: [seconds per kept round]} (rank 0)."""
    import torch
    import torch.distributed as dist

    from megatron_flashoverlap.runtime.timing import interleaved, rank_max, timed

    torch.set_num_threads(1)
    set_policy(cfg["policy"])
    n = cfg["bytes"] // 4
    x, gathered = torch.ones(n), torch.empty(world * n)
    conn, data, buf = _socket_pair(rank), b"x" * cfg["bytes"], memoryview(bytearray(cfg["bytes"]))
    samples = rank_max(interleaved({
        "gloo all-gather": lambda: timed(lambda: dist.all_gather_into_tensor(gathered, x)),
        "TCP socket exchange": lambda: timed(lambda: _exchange(conn, data, buf)),
    }, cfg["rounds"], rotate=True))
    conn.close()
    return samples if rank == 0 else None


def block_rank(rank: int, world: int, cfg: dict) -> dict | None:
    """Part 2 for one arm: {"calibrations": [before, after], "points": [the block with its samples]} (rank 0), the
    shape of one window of the one-window run."""
    import torch

    from benchmarks.harness.line_rate_rs import stock_reduce_scatter
    from benchmarks.planner.window import block_variants, by_method, calibration
    from megatron_flashoverlap.runtime.timing import interleaved, rank_max

    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    pt = cfg["points"][0]
    with stock_reduce_scatter("ring"):
        cal = {**cfg, "rounds": cfg["probe_rounds"]}  # the one-window run's probe rounds
        before = calibration(cal, world)
        variants = block_variants(pt, world)
        for f in variants.values():  # every thread the block uses exists before the policy is set
            f()
        set_policy(cfg["arm"])
        try:
            samples = rank_max(interleaved(variants, cfg["rounds"], rotate=True))
        finally:
            set_policy("default")
        after = calibration(cal, world)
    return {"calibrations": [before, after], "points": [{**pt, "samples": by_method(samples)}]} if rank == 0 else None


# ---- host side ---------------------------------------------------------------------------------------------

def _stalled(s: list) -> int:
    """Rounds more than STALL_S over the median."""
    med = statistics.median(s)
    return sum(x > med + STALL_S for x in s)


def _stats(s: list) -> str:
    deciles = statistics.quantiles(s, n=10, method="inclusive")  # p10 = deciles[0], p90 = deciles[-1]
    return (f"{statistics.median(s) * 1e3:.2f} | {deciles[0] * 1e3:.2f} - {deciles[-1] * 1e3:.2f} | "
            f"{max(s) * 1e3:.2f} | {(max(s) - min(s)) / min(s):.0%} | {_stalled(s)} / {len(s)}")


def render(raw: dict) -> str:
    """The markdown of a run (module docstring) from its samples."""
    from benchmarks.planner import score as SC
    from benchmarks.planner import settings
    from benchmarks.planner.window_predict import predict_window

    md = [f"# The CPU proxy's scheduling, measured\n", f"`{raw['command']}`\n",
          f"2 ranks, {raw['rounds']} rounds a variant (one warm-up round more); a time is the max over the ranks; "
          f"spread = (max - min) / min over the rounds; stalled = rounds more than {STALL_S * 1e3:g} ms over the median. "
          f"Links: "
          f"the namespace's loopback unshaped, and tbf {raw['rate']} with the one-window run's bucket "
          f"({settings.BURST}). Policies: the module docstring of benchmarks/planner/scheduling.py.\n",
          f"## One transfer: {raw['bytes'] // 1024} KiB per rank each way\n",
          "| link | threads | variant | median ms | p10 - p90 ms | max ms | spread | stalled |",
          "|---|---|---|---|---|---|---|---|"]
    for run in raw["transfer"]:
        if run.get("failed"):
            md.append(f"| {run['link']} | {run['policy']} | - | {run['failed']} | | | | |")
            continue
        for v, s in run["samples"].items():
            md.append(f"| {run['link']} | {run['policy']} | {v} | {_stats(s)} |")
    md += ["", f"## The one-window MLP block at tbf {raw['rate']}, priced from the calibrations around it\n",
           "Every predicted figure is a PREDICTION of the planner (window_predict: the mean of the prices from the "
           "calibration before and the one after).\n",
           "| threads | method | mode | predicted ms | measured median ms | p10 - p90 ms | max ms | spread | stalled | "
           "error |", "|---|---|---|---|---|---|---|---|---|---|"]
    summary = ["", "| threads | median abs error | worst | within 10 % | rounds spread, median | stalled rounds |",
               "|---|---|---|---|---|---|"]
    for run in raw["block"]:
        if run.get("failed"):
            md.append(f"| {run['arm']} | - | - | - | {run['failed']} | | | | | |")
            continue
        win = {"name": run["arm"], "world": 2, "calibrations": run["calibrations"], "points": run["points"]}
        rows = SC.errors([win], [predict_window(win)])
        stalled = kept = 0
        for row in rows:
            s = run["points"][0]["samples"][row["method"]][row["mode"]]
            stalled, kept = stalled + _stalled(s), kept + len(s)
            md.append(f"| {run['arm']} | {row['method']} | {row['mode']} | {row['predicted'] * 1e3:.2f} | "
                      f"{_stats(s)} | {row['error']:+.1%} |")
        errs = [abs(r["error"]) for r in rows]
        summary.append(f"| {run['arm']} | {statistics.median(errs):.1%} | {max(errs):.1%} | "
                       f"{sum(e <= 0.10 for e in errs)} / {len(errs)} | "
                       f"{statistics.median(r['spread'] for r in rows):.0%} | "
                       f"{stalled} / {kept} |")
    return "\n".join(md + summary) + "\n"


def _launch(target: str, cfg: dict, rate: str | None, timeout: float):
    from benchmarks.harness.launch import run_ranks
    from benchmarks.harness.netns import shaped_namespace
    from benchmarks.planner import settings as S

    with shaped_namespace(rate, burst=S.BURST) as ns:
        try:
            return run_ranks(target, 2, args=(cfg,), ns=ns, timeout=timeout)[0], None
        except (RuntimeError, TimeoutError) as err:
            return None, f"did not finish: {str(err).splitlines()[0][:120]}"


def measure(a) -> dict:
    from benchmarks.harness.launch import command_line
    from benchmarks.planner import settings as S
    from benchmarks.planner.measure import slow_bytes
    from benchmarks.planner.window_predict import probe_config

    raw = {"command": command_line("planner/scheduling.py", a.argv), "rounds": a.rounds, "bytes": a.bytes,
           "rate": a.rate, "transfer": [], "block": []}
    me = "benchmarks.planner.scheduling"
    for link, rate in (("unshaped", None), (f"tbf {a.rate}", a.rate)):
        for policy in POLICIES:
            print(f"transfer: {link}, {policy}", flush=True)
            res, failed = _launch(f"{me}:transfer_rank", {"bytes": a.bytes, "rounds": a.rounds, "policy": policy},
                                  rate, a.timeout)
            raw["transfer"].append({"link": link, "policy": policy, "samples": res, "failed": failed})
    pt = dict(S.WINDOW_MLP)
    probe = probe_config([pt], 2, S.TBF_PROBE, slow_bytes(a.rate))
    for arm in ARMS:
        print(f"block: {arm}", flush=True)
        cfg = {"gpus_per_node": 2, "rounds": a.rounds, "probe_rounds": 9, "passes": 1, "points": [pt], "probe": probe,
               "arm": arm}
        res, failed = _launch(f"{me}:block_rank", cfg, a.rate, a.timeout)
        raw["block"].append({"arm": arm, **(res or {}), "failed": failed})
    return raw


def main(argv=None) -> int:
    from benchmarks.harness.cli import out_dir, parser
    from benchmarks.harness.launch import write_text
    from benchmarks.harness.netns import why_not_shaped

    p = parser(__doc__, "planner", "It needs root (namespaces, tc, real-time scheduling policies).")
    p.add_argument("--rate", default="4gbit", help="tbf rate of the shaped link (default 4gbit)")
    p.add_argument("--bytes", type=int, default=512 * 1024, help="bytes per rank of part 1's transfer")
    p.add_argument("--rounds", type=int, default=41)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds a launch may take")
    p.add_argument("--render", default=None, help="a run's JSON: write its markdown beside it, measure nothing")
    p.add_argument("--out", default=out_dir("planner"))
    a = p.parse_args(argv)
    a.argv = sys.argv[1:] if argv is None else list(argv)
    if a.render:
        with open(a.render) as f:
            raw = json.load(f)
        write_text(os.path.splitext(a.render)[0] + ".md", render(raw))
        return 0
    why = why_not_shaped()
    if why:
        print(why, file=sys.stderr)
        return 2
    raw = measure(a)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "scheduling.json"), "w") as f:
        json.dump(raw, f)
    write_text(os.path.join(a.out, "scheduling.md"), render(raw))
    return 0


if __name__ == "__main__":
    sys.exit(main())
