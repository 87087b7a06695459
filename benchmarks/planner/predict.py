"""The planner's predictions of the committed tables' points, from a calibration (calibrate.py) and the tables'
settings (settings.py) only: no measured block time enters.

    envs(cal)                     -> {key: Env} per (rate, P) on the shared tbf queue, and the two-level one
    predict_all(cal) -> {"overlap": {point: {method: s}}, "moe": ..., "topology": ...}
    shapes()         -> the GEMM and GELU shapes the predictions price (what calibrate.py must measure)
A point key: "overlap|<rate>|<seq>|<mode>|<raw>", "moe|<P>|<rate>|<mode>", "topology|<P>|<bytes>".
"""
from __future__ import annotations

from megatron_flashoverlap.plan import collectives as CL
from megatron_flashoverlap.plan import ops
from megatron_flashoverlap.plan.gemm import GemmModel, TableGemm
from megatron_flashoverlap.plan.hardware import Cluster
from megatron_flashoverlap.plan.links import Group
from megatron_flashoverlap.plan.price import Env
from megatron_flashoverlap.plan.proxy import Fit, ProxyNet, fit, link_of, proxy_gpu

from benchmarks.planner import settings as S


STAT = "lo"  # the statistic of a calibration figure: "lo" (min over rounds) or "median" (predict_all's stat=)


def _fig(entry: dict) -> float:
    return entry[STAT]


def _fit(section: dict, prefix: str, per: int = 1) -> Fit:
    """The (bytes, seconds / per) fit of one probe; a hop probe is a walk of P - 1 hops (per = P - 1)."""
    pts = [(float(k.split(":")[1]), _fig(v) / per) for k, v in section.items() if k.startswith(prefix + ":")]
    return fit(pts)


def _fits(section: dict, p: int) -> dict:
    return {"hop": _fit(section, "hop", p - 1), "allgather": _fit(section, "allgather"),
            "allreduce": _fit(section, "allreduce")}


def _gemm_rows(cal: dict, world: int) -> dict:
    return {tuple(int(v) for v in k.split(",")): _fig(s) for k, s in cal[f"compute_{world}"]["gemm"].items()}


def _add_fit(cal: dict, world: int) -> Fit:
    return fit([(float(k), _fig(v)) for k, v in cal[f"compute_{world}"]["add"].items()])


def _slowdown(link_cal: dict) -> float:
    s = link_cal["slowdown"]
    return min(1.9, max(0.0, _fig(s["beside"]) / _fig(s["alone"]) - 1.0))


def shared_env(cal: dict, rate: str, p: int) -> Env:
    """The P-rank proxy on one tbf at `rate`: links calibrated on P ranks at that rate, GEMMs on P ranks, the
    compute slowdown beside a transfer from the P = 2 run at that rate."""
    fits = _fits(cal[f"link_{rate}_{p}"]["link"], p)
    gpu = proxy_gpu(_add_fit(cal, p))
    link = link_of(f"tbf {rate}", fits["hop"])
    cluster = Cluster(gpu, link, link, gpus_per_node=p, nodes=1, nics_per_node=1,
                      slowdown=_slowdown(cal[f"link_{rate}_2"]))
    return Env(cluster, "fp32", TableGemm(gpu, "fp32", _gemm_rows(cal, p)), ProxyNet(cluster, fits))


def two_level_env(cal: dict, p: int, local: int) -> Env:
    """P ranks, `local` per node, htb per node: the P-rank htb run gives the per-step host cost (alpha) and the
    inter-node rate (a ring step waits for its node-crossing edge), the unshaped 2-rank run the intra rate."""
    fits = _fits(cal[f"link_htb_{p}"]["link"], p)
    intra = _fit(cal["link_unshaped_2"]["link"], "hop")
    gpu = proxy_gpu(_add_fit(cal, 2))
    cluster = Cluster(gpu, link_of("loopback", Fit(fits["hop"].alpha, intra.per_byte)), link_of("htb", fits["hop"]),
                      gpus_per_node=local, nodes=p // local, nics_per_node=1, slowdown=0.0)
    return Env(cluster, "bf16", TableGemm(gpu, "bf16", _gemm_rows(cal, 2)), ProxyNet(cluster, fits, shared=False))


def _gelu(cal: dict):
    """gelu(rows, width, bwd) -> seconds of F.gelu's forward (its backward: bwd) from the calibration."""
    return lambda rows, width, bwd: _fig(cal["compute_2"]["gelu"][f"{rows},{width}" + (",bwd" if bwd else "")])


def mlp_block(env: Env, seq: int, hidden: int, width: int, gelu) -> dict:
    """{mode: {variant: s}} of the benchmarks' MLP block (benchmarks/harness/blocks.py) on P ranks; gelu(rows,
    width, bwd) prices its activation."""
    g = Group(env.cluster.world, env.cluster.world)
    n = width * g.size
    fwd = [ops.column_fwd(env, g, seq, hidden, n), ops.row_fwd(env, g, seq, n, hidden)]
    bwd = [ops.row_bwd(env, g, seq, n, hidden), ops.column_bwd(env, g, seq, hidden, n)]
    gf, gb = gelu(seq, width, False), gelu(seq, width, True)
    keys = set.intersection(*(set(o.times) for o in fwd + bwd))
    out = {"fwd": {v: sum(o.times[v] for o in fwd) + gf for v in keys}}
    out["fwd+bwd"] = {v: out["fwd"][v] + sum(o.times[v] for o in bwd) + gb for v in keys}
    return out


def predict_overlap(cal: dict) -> dict:
    out = {}
    for raw, rate, seqs, hidden, width, methods in S.OVERLAP:
        env = shared_env(cal, rate, 2)
        for seq in seqs:
            block = mlp_block(env, seq, hidden, width, _gelu(cal))
            for mode in S.MODES:
                out[f"overlap|{rate}|{seq}|{mode}|{raw}"] = {m: block[mode][S.VARIANT[m]] for m in methods}
    return out


def predict_moe(cal: dict) -> dict:
    m, out = S.MOE, {}
    for p, rate in m["points"]:
        env = shared_env(cal, rate, p)
        g = Group(p, p)
        args = (env, g, m["tokens"], (m["hidden"], m["ffn"], 1), (m["experts"] // p, m["topk"]))
        fwd, bwd = CL.moe(*args), CL.moe(*args, backward=True)
        for mode in S.MODES:
            out[f"moe|{p}|{rate}|{mode}"] = {
                k: fwd.times[v] + (bwd.times[v] if mode == "fwd+bwd" else 0.0) for k, v in S.MOE_VARIANT.items()}
    return out


def predict_topology(cal: dict) -> dict:
    t, out = S.TOPOLOGY, {}
    for p, local in t["layouts"]:
        env = two_level_env(cal, p, local)
        g = Group(p, local)
        for nbytes in t["sizes"]:
            times = CL.all_reduce(env, g, nbytes).times
            out[f"topology|{p}|{nbytes}"] = {k: times[v] for k, v in S.TOPOLOGY_VARIANT.items()}
    return out


def predict_all(cal: dict, stat: str = "lo") -> dict:
    """Every prediction, each calibration figure taken as `stat` over its rounds ("lo": the minimum, the
    machine with the least interference from other load; "median")."""
    global STAT
    previous, STAT = STAT, stat
    try:
        return {"overlap": predict_overlap(cal), "moe": predict_moe(cal), "topology": predict_topology(cal)}
    finally:
        STAT = previous


class ShapeRecorder(GemmModel):
    """A GEMM model that records every (m, k, n) it is asked to price (and prices each 1 ms)."""

    def __init__(self, gpu):
        super().__init__(gpu, "fp32")
        self.seen = set()

    def time(self, m, k, n):
        if m > 0 and k > 0 and n > 0:
            self.seen.add((m, k, n))
        return 1e-3


def shapes() -> dict:
    """{"gemm_2": [(m, k, n)], "gemm_4": [...], "gelu": [(rows, width)]} every prediction prices."""
    dummy = Fit(1e-4, 1e-8)
    fits = {"hop": dummy, "allgather": dummy, "allreduce": dummy}
    out = {}
    gelu: set = set()
    for p in (2, 4):
        gpu = proxy_gpu(dummy)
        link = link_of("dummy", dummy)
        cluster = Cluster(gpu, link, link, p, 1, 1, 0.0)
        rec = ShapeRecorder(gpu)
        env = Env(cluster, "fp32", rec, ProxyNet(cluster, fits))
        if p == 2:
            for _, _, seqs, hidden, width, _ in S.OVERLAP:
                for seq in seqs:
                    mlp_block(env, seq, hidden, width, lambda r, w, b: gelu.add((r, w)) or 0.0)
        m = S.MOE
        for q, _ in m["points"]:
            if q == p:
                args = (env, Group(p, p), m["tokens"], (m["hidden"], m["ffn"], 1), (m["experts"] // p, m["topk"]))
                CL.moe(*args), CL.moe(*args, backward=True)
        out[f"gemm_{p}"] = sorted(rec.seen)
    out["gelu"] = sorted(gelu)
    return out
