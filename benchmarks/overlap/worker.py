"""One benchmark run on every rank (started by benchmarks/harness/launch.py `run_ranks`, inside the shaped namespace).

    run_ranks("benchmarks.overlap.worker:main", 2, args=(CONFIG,))  -> [OUT, None]

CONFIG: {"kinds": ["mlp", "attn"], "seqs": [...], "batch", "hidden", "width", "head_dim", "repeats",
         "attn_max_seq" (optional: the attention block only up to this length; its core is O(s^2)),
         "methods": [names], "trace": {"kind", "seq", "methods": [names]} or null, "label": str,
         "megatron": {"seq", "methods"} or null (adds rows for the real Megatron MLP: stock spec vs ours per
                     method, `auto` among them: the layers' chooser; default: "methods" above),
         "stock_rs": "ring" (default: reduce-scatters outside our rings as P2P rings, benchmarks/harness/line_rate_rs.py)
                     or "gloo" (gloo's own, an all-reduce's bytes)}
OUT (returned by rank 0): config, world, probes (link bandwidth, GEMM throughput, middle-part times),
rows (one per kind x seq x method x mode with medians and spread), trace events per rank.
"""
from __future__ import annotations

import statistics

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_flashoverlap.runtime import OverlapContext, all_gather_into
from benchmarks.harness.blocks import Shape, method_by_name
from benchmarks.harness.progress import Progress
from megatron_flashoverlap.runtime.timing import interleaved, rank_max, timed
from benchmarks.harness.timing import MEASURES, MODES, Runner, combine, derived, fake_group, measure


def _median_time(fn, n: int = 3) -> float:
    """Median over n rounds (no warm-up) of one call on this rank."""
    return statistics.median(interleaved({"probe": lambda: timed(fn)}, n, warmup=0)["probe"])


def probe_link(world: int, mib: float = 4.0) -> float:
    """Bytes per second each rank receives in a stock all-gather of `mib` MiB per rank (max over ranks)."""
    x = torch.ones(int(mib * 2 ** 20) // 4)
    out = torch.empty(world * x.numel())
    t = _max_over_ranks(_median_time(lambda: all_gather_into(out, x, None)))
    return (world - 1) * x.numel() * 4 / t


def probe_latency(world: int) -> float:
    """Seconds of a stock all-gather of 4 bytes per rank (max over ranks): the per-message cost."""
    x, out = torch.ones(1), torch.empty(world)
    return _max_over_ranks(_median_time(lambda: all_gather_into(out, x, None), n=5))


def probe_gemm(hidden: int, width: int, rows_list) -> dict:
    """{rows: flop/s} of F.linear([rows, h], [w, h]) on one thread, both ranks busy at once."""
    w = torch.randn(width, hidden)
    res = {}
    for rows in rows_list:
        x = torch.randn(rows, hidden)
        F.linear(x, w)
        t = _max_over_ranks(_median_time(lambda: F.linear(x, w)))
        res[int(rows)] = 2.0 * rows * hidden * width / t
    return res


def _max_over_ranks(v: float) -> float:
    return rank_max({"v": [v]})["v"][0]


def _gathered(obj):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _trace(runner: Runner, methods, fake) -> dict:
    """One block per method and mode with the executor's tracer on: {method|mode: {"events", "spans"}}."""
    out = {}
    for m in methods:
        for mode in MODES:
            ctx = OverlapContext(check_peers=False, trace=[])
            spans: list = []
            runner.call(runner.full, None, m, mode, ctx=ctx, spans=spans)
            events = [(e.what, e.label, e.start, e.end) for e in ctx.trace]
            out[f"{m.name}|{mode}"] = {"events": events, "spans": spans}
    return out


def _probes(cfg: dict, world: int) -> dict:
    """Link bandwidth and latency, GEMM flop/s at every slice row count of the sweep (cost-model inputs)."""
    b = cfg["batch"]
    rows_list = sorted({max(1, s * b // (world * k)) for s in cfg["seqs"] for k in (1, 2, 4, 8)}
                       | {s * b for s in cfg["seqs"]})
    return {"link_Bps": probe_link(world), "latency_s": probe_latency(world),
            "gemm_flops": probe_gemm(cfg["hidden"], cfg["width"], rows_list), "middle_s": {}}


def _point(cfg: dict, kind: str, seq: int, methods, fake, probes: dict, bar) -> tuple[list, list]:
    """Rows of one (kind, seq) for every method and mode, plus its trace when cfg asks for it."""
    world = dist.get_world_size()
    runner = Runner(kind, Shape(seq, cfg["batch"], cfg["hidden"], cfg["width"], cfg.get("head_dim", 64)), world)
    full_in = torch.randn(seq, cfg["batch"], runner.full.w_in.shape[0])
    probes["middle_s"][f"{kind}|{seq}"] = _max_over_ranks(_median_time(lambda: runner.full._middle(full_in)))
    stats = combine(measure(runner, methods, cfg["repeats"], None, fake, bar.tick))
    rows = [{"kind": kind, "seq": seq, "method": m.name, "mode": mode, **derived(stats, m.name, mode)}
            for m in methods for mode in MODES]
    tr = cfg.get("trace")
    if tr and tr["kind"] == kind and tr["seq"] == seq:
        return rows, _gathered(_trace(runner, [method_by_name(n) for n in tr["methods"]], fake))
    return rows, []


def run(cfg: dict) -> dict | None:
    """The whole configured sweep on this rank; rank 0 returns the output dict, the others None."""
    rank, world = dist.get_rank(), dist.get_world_size()
    fake = fake_group(world)
    methods = [method_by_name(n) for n in cfg["methods"]]
    probes = _probes(cfg, world)
    todo = [(k, s) for k in cfg["kinds"] for s in cfg["seqs"] if k != "attn" or s <= cfg.get("attn_max_seq", s)]
    calls = (cfg["repeats"] + 1) * len(methods) * len(MODES) * len(MEASURES)  # one tick per measured call
    bar = Progress(len(todo) * calls, cfg.get("label", ""), enabled=rank == 0)
    rows, traces = [], []
    for kind, seq in todo:
        more, tr = _point(cfg, kind, seq, methods, fake, probes, bar)
        rows += more
        traces = tr or traces
    bar.close()
    mrows = _megatron(cfg, methods) if cfg.get("megatron") else []
    if rank != 0:
        return None
    return {"config": cfg, "world": world, "probes": probes, "rows": rows, "traces": traces, "megatron_rows": mrows}


def _megatron(cfg: dict, methods) -> list[dict]:
    """Rows for the real Megatron MLP (stock spec vs ours) at cfg["megatron"]["seq"]."""
    from benchmarks.harness.megatron_rows import measure_megatron

    methods = [method_by_name(n) for n in cfg["megatron"]["methods"]] if "methods" in cfg["megatron"] else methods
    return measure_megatron(cfg["megatron"]["seq"], cfg["batch"], cfg["hidden"], cfg["width"], methods,
                            cfg["repeats"])


def main(rank: int, world: int, cfg: dict) -> dict | None:
    """The rank entry for `run_ranks` (gloo already up): one thread, denormals flushed, then `run`."""
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)  # the fake group leaves receive buffers uninitialised: no denormal slow-down
    from benchmarks.harness.line_rate_rs import stock_reduce_scatter

    with stock_reduce_scatter(cfg.get("stock_rs", "ring")):  # stock's and slicing's reduce-scatters
        return run(cfg)
