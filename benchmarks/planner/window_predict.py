"""The one-window run's predictions: every measured point priced by the planner on the proxy built from the
chooser's probe (plan/proxy.probed_env) of the calibration taken next to it (window.py), from its settings only.

    env_of(cal, element_bytes) -> Env          a calibration's probe figures, add fit and slowdown
    price(pt, cal) -> {method: {mode: seconds}}   one point's settings (settings.WINDOW_*) on that calibration
    predict_window(win) -> [{"before": ..., "after": ...} per point]   each point from the calibration taken just
                                                  before it (the primary) and the one just after it
    probe_config(points, world, sizes, slow_bytes) -> window.py's cfg["probe"]: what the points price (GEMM and
                                                  GELU shapes)
Every figure of a calibration is its median (the probe's own statistic), as a point's measured time is.
"""
from __future__ import annotations

from megatron_flashoverlap.plan import collectives as CL
from megatron_flashoverlap.plan.hardware import Cluster
from megatron_flashoverlap.plan.links import Group
from megatron_flashoverlap.plan.price import Env
from megatron_flashoverlap.plan.proxy import Fit, ProxyNet, fit, link_of, probed_env, proxy_gpu

from benchmarks.planner import settings as S
from benchmarks.planner.measure import ADDS, SLOW_GEMM
from benchmarks.planner.predict import ShapeRecorder, mlp_block

MODES = ("fwd", "fwd+bwd")
ELEMENT_BYTES = {"float32": 4, "bfloat16": 2}


def _slowdown(cal: dict) -> float:
    s = cal.get("slowdown")
    if not s:
        return 0.0
    return min(1.9, max(0.0, s["beside"]["median"] / s["alone"]["median"] - 1.0))


def env_of(cal: dict, element_bytes: int = 4) -> Env:
    add = fit([(float(k), v["median"]) for k, v in cal["add"].items()])
    return probed_env(cal["probe"], add, _slowdown(cal), element_bytes)


def _gelu(cal: dict):
    return lambda rows, width, bwd: cal["gelu"][f"{rows},{width}" + (",bwd" if bwd else "")]["median"]


def _mlp(env: Env, pt: dict, gelu) -> dict:
    block = mlp_block(env, pt["seq"], pt["hidden"], pt["width"], gelu)
    return {m: {mode: block[mode][S.VARIANT[m]] for mode in MODES} for m in pt["methods"]}


def _mlp_nosp(env: Env, pt: dict, gelu) -> dict:
    """harness/blocks.NoSPMlpBlock: fc1 x [s, h] @ w1^T [h, w] (its backward all-reduces dx: ar_bwd), gelu, fc2
    AR(a [s, w] @ w2^T [w, h]) (ar_fwd; its backward: dgrad dy @ w2, wgrad dy^T a, no communication)."""
    p = env.cluster.world
    g, (s, h, w) = Group(p, p), (pt["seq"], pt["hidden"], pt["width"])
    fc2, fc1_bwd = CL.ar_fwd(env, g, s, w * p, h), CL.ar_bwd(env, g, s, h, w * p)
    fwd = env.mm(s, h, w) + gelu(s, w, False)
    bwd = env.mm(s, h, w) + env.mm(h, s, w) + gelu(s, w, True)
    out = {}
    for m in pt["methods"]:
        v = S.NOSP_VARIANT[m]
        out[m] = {"fwd": fwd + fc2.times[v], "fwd+bwd": fwd + fc2.times[v] + bwd + fc1_bwd.times[v]}
    return out


def _moe(env: Env, pt: dict, gelu) -> dict:
    p = env.cluster.world
    args = (env, Group(p, p), pt["tokens"], (pt["hidden"], pt["ffn"], 1), (pt["experts"] // p, pt["topk"]))
    fwd, bwd = CL.moe(*args), CL.moe(*args, backward=True)
    out = {}
    for m in pt["methods"]:
        v = S.MOE_VARIANT[m]
        out[m] = {"fwd": fwd.times[v], "fwd+bwd": fwd.times[v] + bwd.times[v]}
    return out


def _all_reduce(env: Env, pt: dict, gelu) -> dict:
    g = Group(env.cluster.world, pt["local"])
    times = {n: CL.all_reduce(env, g, n).times for n in pt["sizes"]}
    return {m: {str(n): times[n][S.TOPOLOGY_VARIANT[m]] for n in pt["sizes"]} for m in pt["methods"]}


PRICE = {"mlp": _mlp, "mlp_nosp": _mlp_nosp, "moe": _moe, "all_reduce": _all_reduce}


def price(pt: dict, cal: dict) -> dict:
    """{method: {mode: predicted seconds}} of the point `pt` on calibration `cal` (module docstring)."""
    env = env_of(cal, ELEMENT_BYTES[pt.get("dtype", "float32")])
    return PRICE[pt["kind"]](env, pt, _gelu(cal))


def predict_window(win: dict) -> list[dict]:
    """Per point of one window's run (window.py's output): its prices from the calibration before and after."""
    cals = win["calibrations"]
    return [{"before": price(pt, cals[i]), "after": price(pt, cals[i + 1])} for i, pt in enumerate(win["points"])]


def probe_config(points, world: int, sizes, slow_bytes: int | None = None) -> dict:
    """window.py's cfg["probe"] for `points` on `world` ranks (module docstring); slow_bytes: the all-gather
    beside the slowdown's GEMM (None: no slowdown figure)."""
    dummy = Fit(1e-4, 1e-8)
    gpu, link = proxy_gpu(dummy), link_of("dummy", dummy)
    cluster = Cluster(gpu, link, link, world, 1, 1, 0.0)
    rec = ShapeRecorder(gpu)
    env = Env(cluster, "fp32", rec, ProxyNet(cluster, {"hop": dummy, "allgather": dummy, "allreduce": dummy}))
    gelu: set = set()
    for pt in points:
        if pt["kind"] != "all_reduce":
            PRICE[pt["kind"]](env, pt, lambda r, w, b: gelu.add((r, w)) or 0.0)
    dtype = next((pt["dtype"] for pt in points if "dtype" in pt), "float32")
    return {"shapes": sorted(rec.seen), "sizes": list(sizes), "dtype": dtype, "gelu": sorted(gelu), "add": list(ADDS),
            "slowdown": [list(SLOW_GEMM), slow_bytes] if slow_bytes else None}
