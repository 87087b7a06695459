"""The layers' automatic choices from a start-up probe (pure: the probe's figures in, choices out; the GPU side
that measures the figures is megatron/probe.py).

    Figures (a JSON-able dict, identical on every rank: the probe takes the max over ranks of each figure)
        {"device": "NVIDIA H100 80GB HBM3", "backend": "nccl", "dtype": "bf16", "gpus_per_node": G, "nodes": N,
         "gemm": [[m, k, n, seconds], ...],          GEMMs of the model's own sites, whole and 1/P slices
         "intra": [[bytes, seconds], ...],           one point-to-point hop between two GPUs of a node (every
                                                     GPU exchanging at once, as a ring step does)
         "inter": [[bytes, seconds], ...]}           the same between nodes (empty on one node)
    hardware(figures) -> (Gpu, intra Link, inter Link): the catalogue's entry for the device (by name; else the
        fastest probed GEMM as its peak), the links' per-hop cost and rate FITTED to the probe (proxy.fit); NCCL's
        collective efficiencies and latencies stay the catalogue's (the probe times no collective)
    hardware_json(figures) -> {"gpus": {...}, "links": {...}}: the same as a --hardware file (hardware.load_hardware)
    choose(figures, model, layout) -> Choices: per TP site the plan knobs (algo, num_chunks, hop_chunks), the
        matmul_all_reduce chunk count (TP without SP), the DP fusion (all / none), the decode all-reduce table
        (the calibration format of ops/all_reduce/select.py, predicted), one log line
    probe_shapes(model, layout), partners(rank, world, G): what the probe times, and with whom each rank exchanges
    apply(choices, cfg) -> FlashOverlapConfig: the YAML wins: a layer keeps its plan (the planner only fills
        hop_chunks where a flash layer left it open; an auto layer is measured, the planner's pick its model tier,
        plan/chooser.py); dp.fuse "auto" becomes the planner's; all_reduce.num_chunks only where the YAML left it
Every number here is a PREDICTION of the planner (plan/train_step.py) priced on the probed figures.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ..config import LAYERS, FlashOverlapConfig
from . import catalog
from .collectives import all_reduce
from .gemm import TableGemm
from .hardware import Cluster, Gpu, Link
from .links import place
from .model import Layout, Model
from .price import Env
from .proxy import fit
from .train_step import plan_step

DECODE_SIZES = tuple(8192 * 2 ** i for i in range(11))  # 8 KB .. 8 MB, the calibration's window
DEVICE_NAMES = (("H200", "h200"), ("H100", "h100"), ("H800", "h800"), ("B200", "b200"), ("A100", "a100"),
                ("A800", "a800"))
_TORCH_DTYPE = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


@dataclass(frozen=True)
class Choices:
    sites: dict  # layer -> {"algo", "num_chunks", "hop_chunks"}
    ar_chunks: int | None  # matmul_all_reduce's C (TP without SP), None with SP
    dp_fuse: str  # "all" / "none"
    decode_table: dict | None  # {"tables": [...]} or None (TP = 1)
    log: str = ""
    predicted: dict = field(default_factory=dict)  # stock / ours step seconds (predictions)


def gpu_key(device: str) -> str | None:
    """The catalogue's GPU for a device name ("NVIDIA H100 80GB HBM3" -> "h100"), None if unknown."""
    for word, key in DEVICE_NAMES:
        if word in device.upper():
            return key
    return None


def _check(figures: dict) -> None:
    missing = [k for k in ("device", "gpus_per_node", "nodes", "gemm", "intra") if k not in figures]
    if missing:
        raise ValueError(f"probe figures lack {missing}; megatron/probe.py writes them")
    if not figures["gemm"] or any(len(r) != 4 or r[3] <= 0 for r in figures["gemm"]):
        raise ValueError("probe figures: 'gemm' needs rows [m, k, n, seconds > 0]")


def _probed_link(base: Link, rows, name: str) -> Link:
    if len(rows) < 2:
        return base
    f = fit([(b, s) for b, s in rows])
    rate = 1.0 / max(f.per_byte, 1e-15) / base.p2p_efficiency  # the raw rate, as the catalogue's gbps is
    return dataclasses.replace(base, name=name, gbps=rate / 1e9, p2p_us=f.alpha * 1e6)


def hardware(figures: dict) -> tuple[Gpu, Link, Link]:
    """(Gpu, intra, inter) from the probe (module docstring)."""
    _check(figures)
    dtype = figures.get("dtype", "bf16")
    key = gpu_key(figures["device"])
    if key is not None:
        gpu = dataclasses.replace(catalog.GPUS[key], name=f"probed-{key}")
    else:
        best = max(2.0 * m * k * n / s for m, k, n, s in figures["gemm"]) / 1e12
        gpu = Gpu("probed", {dtype: best}, hbm_gbps=1000.0, sms=100, gemm_efficiency=1.0)
    intra0 = catalog.LINKS[catalog.GPU_INTRA.get(key or "h100")]
    inter0 = catalog.LINKS[catalog.DEFAULT_INTER]
    return (gpu, _probed_link(intra0, figures["intra"], "probed-intra"),
            _probed_link(inter0, figures.get("inter") or [], "probed-inter"))


def hardware_json(figures: dict) -> dict:
    """The probe as a --hardware file (hardware.load_hardware's form)."""
    gpu, intra, inter = hardware(figures)
    as_dict = (lambda obj: {k: (dict(v) if k == "peak_tflops" else v) for k, v in dataclasses.asdict(obj).items()
                            if k != "name"})
    return {"gpus": {gpu.name: as_dict(gpu)}, "links": {intra.name: as_dict(intra), inter.name: as_dict(inter)}}


def env_of(figures: dict, slowdown: float = 0.10) -> Env:
    gpu, intra, inter = hardware(figures)
    dtype = figures.get("dtype", "bf16")
    g = int(figures["gpus_per_node"])
    cluster = Cluster(gpu, intra, inter, g, int(figures["nodes"]), g, slowdown)
    rows = {(int(m), int(k), int(n)): float(s) for m, k, n, s in figures["gemm"]}
    return Env(cluster, dtype, TableGemm(gpu, dtype, rows))


def _knobs(variant: str, sequence_parallel: bool) -> dict:
    algo, _, n = variant.partition(":")
    if algo == "slicing":
        return {"algo": "slicing", "num_chunks": int(n), "hop_chunks": None}
    if algo == "flash" and sequence_parallel:
        return {"algo": "flash", "num_chunks": None, "hop_chunks": int(n or 1)}
    return {"algo": algo, "num_chunks": None, "hop_chunks": None}


def decode_table(env: Env, tp: int, dtype: str, backend: str = "nccl") -> dict | None:
    """The decode all-reduce's predicted table over the TP group, in ops/all_reduce/select.py's format."""
    if tp < 2:
        return None
    g = place(tp, 1, env.cluster)
    rows = []
    for nbytes in DECODE_SIZES:
        t = all_reduce(env, g, nbytes).times
        rows.append({"bytes": nbytes, "reference_us": t["reference"] * 1e6,
                     **{f"{a.split(':')[1]}_us": s * 1e6 for a, s in t.items() if a.startswith("flash:")}})
    dtypes = sorted({_TORCH_DTYPE.get(dtype, dtype), "bfloat16", "float16"})  # a message's time is its bytes'
    return {"tables": [{"world_size": tp, "local_world_size": g.per_node, "backend": backend, "dtype": d,
                        "source": "planner prediction", "rows": rows} for d in dtypes]}


def choose(figures: dict, model: Model, layout: Layout, slowdown: float = 0.10) -> Choices:
    """The planner's choices on the probed machine (module docstring)."""
    env = env_of(figures, slowdown)
    st = plan_step(env, model, layout)
    sites = {name: _knobs(s.variant, layout.sequence_parallel) for name, s in st.layer.sites.items()}
    ar = None
    if not layout.sequence_parallel and layout.tp > 1:
        flashes = [s.variant for s in st.layer.sites.values() if s.variant.startswith("flash:")]
        ar = int(flashes[0].split(":")[1]) if flashes else None
    fuse = "all" if st.dp_fuse else "none"
    picks = " ".join(f"{n}={k['algo']}" + (f":{k['num_chunks'] or k['hop_chunks']}"
                                           if (k["num_chunks"] or k["hop_chunks"]) else "")
                     for n, k in sites.items())
    log = (f"planner (prediction) on {figures['device']} x {env.cluster.world}: {picks}; dp.fuse {fuse}; "
           f"step stock {st.step(True) * 1e3:.1f} ms -> ours {st.step(False) * 1e3:.1f} ms")
    return Choices(sites, ar, fuse, decode_table(env, layout.tp, env.dtype, figures.get("backend", "nccl")), log,
                   {"stock_s": st.step(True), "ours_s": st.step(False)})


def apply(choices: Choices, cfg: FlashOverlapConfig) -> FlashOverlapConfig:
    """cfg with the planner's choices where the YAML left them open (module docstring)."""
    plans = {}
    for layer in LAYERS:
        mine, pick = cfg.plan(layer), choices.sites.get(layer)
        if pick is not None and mine.algo == "flash" == pick["algo"] and mine.hop_chunks is None:
            plans[layer] = dataclasses.replace(mine, hop_chunks=pick["hop_chunks"])
    ar = cfg.all_reduce
    ar = dataclasses.replace(ar, num_chunks=ar.num_chunks or choices.ar_chunks)
    dp = cfg.dp if cfg.dp.fuse != "auto" else dataclasses.replace(cfg.dp, fuse=choices.dp_fuse)
    return dataclasses.replace(cfg, **plans, all_reduce=ar, dp=dp)


def probe_shapes(model: Model, layout: Layout) -> list[tuple[int, int, int]]:
    """The GEMMs the probe times: each TP site's forward GEMM whole (per rank) and in 1/P row slices, its
    dgrad and wgrad; the planner prices every other shape from the nearest of these (gemm.TableGemm)."""
    tokens = model.seq // layout.cp * model.micro_batch
    p, out = layout.tp, set()
    for kind, m, k, n in model.sites(tokens).values():
        k_r, n_r = (k, n // p) if kind == "column" else (k // p, n)
        for rows in {m, max(1, m // p)}:
            out.add((rows, k_r, n_r))
        out.add((m, n_r, k_r))  # dgrad
        out.add((k_r, m, n_r))  # wgrad
    return sorted(out)


def partners(rank: int, world: int, gpus_per_node: int) -> tuple[int | None, int | None]:
    """(intra, inter) partner of `rank`: rank ^ 1 inside its node; the same local rank on the paired node (nodes
    2i and 2i + 1); None where it has none (a node of one GPU, an odd last node)."""
    intra = rank ^ 1 if gpus_per_node > 1 and (rank ^ 1) // gpus_per_node == rank // gpus_per_node else None
    node, nodes = rank // gpus_per_node, world // gpus_per_node
    pair = node + 1 if node % 2 == 0 else node - 1
    inter = rank + (pair - node) * gpus_per_node if nodes > 1 and pair < nodes else None
    return (intra if intra is not None and intra < world else None), inter
