"""The plan as text (one line per choice, saying why) and as numbers (JSON). Every figure is a PREDICTION."""
from __future__ import annotations

from .layer_times import Site
from .price import Env
from .train_step import StepTimes

LABEL = "PREDICTION of the planner's model (not a measurement)"


def _ms(s: float) -> str:
    return f"{s * 1e3:.3f}"


def why(site: Site, p: int) -> str:
    """One line: what decided the site (hop vs slice, what slicing costs, what stays exposed)."""
    if site.op.comm <= 0:
        return "no communication at this site (a group of one): Megatron's own path"
    f = site.fwd if site.fwd.ring > 0 else site.op  # TP without SP: a column site communicates in backward only
    hop = f.ring / max(p - 1, 1)
    piece = f.compute / max(p, 1)
    exp_s, exp_o = site.stock - site.op.compute, site.time - site.op.compute
    where = "forward" if f is site.fwd else "forward+backward"
    head = (f"{where} hop {_ms(hop)} ms {'<=' if hop <= piece else '>'} GEMM slice {_ms(piece)} ms; exposed "
            f"{_ms(exp_s)} -> {_ms(exp_o)} ms")
    if site.algo == "reference":
        best = min((a for a in site.op.algos() if a != "reference"), key=site.op.time)
        return (f"{head}; stock kept: the best overlap ({best}, {_ms(site.op.time(best))} ms) loses more to "
                f"slicing the GEMM and contention than the {_ms(exp_s)} ms of communication it would hide")
    if site.algo in ("flash", "flash_bidir"):
        state = "every hop hides under a slice" if hop <= piece else "link-bound: hops outlast slices, no tail"
        return f"{head}; {site.variant}: {state}"
    return (f"{head}; {site.variant}: {site.variant.split(':')[1]} chunks keep the GEMM efficient; its tail costs "
            f"less than a {p}-way sliced GEMM")


def _site_json(site: Site, p: int) -> dict:
    return {"choice": site.variant, "stock_ms": site.stock * 1e3, "ours_ms": site.time * 1e3,
            "compute_ms": site.op.compute * 1e3, "exposed_stock_ms": (site.stock - site.op.compute) * 1e3,
            "exposed_ours_ms": (site.time - site.op.compute) * 1e3, "bound_ms": site.op.bound * 1e3,
            "variants_ms": {k: v * 1e3 for k, v in sorted(site.op.times.items())}, "why": why(site, p)}


def _group_size(name: str, st: StepTimes) -> int:
    return {"ulysses": st.layout.cp, "moe": st.layout.ep}.get(name, st.layout.tp)


def to_json(st: StepTimes, inputs: dict) -> dict:
    lt = st.layer
    out = {"label": "prediction", "inputs": inputs,
           "sites": {n: _site_json(s, _group_size(n, st)) for n, s in lt.sites.items()},
           "extras": {n: _site_json(s, _group_size(n, st)) for n, s in lt.extras.items()},
           "layer_ms": {"stock": lt.total(True) * 1e3, "ours": lt.total(False) * 1e3, "fixed": lt.fixed * 1e3},
           "step_s": {"stock": st.step(True), "flash_overlap": st.step(False)},
           "microbatches": st.microbatches,
           "dp": {"fuse": st.dp_fuse, "exposed_stock_ms": st.dp_stock.exposed * 1e3,
                  "exposed_ours_ms": st.dp_ours.exposed * 1e3, "extra_ours_ms": st.dp_ours.extra * 1e3}}
    if st.decode is not None:
        d = st.decode
        out["decode_all_reduce"] = {"reference_us": d.times["reference"] * 1e6,
                                    "ours_us": {k.split(":")[1]: v * 1e6 for k, v in d.times.items() if ":" in k},
                                    "choice": d.choice()}
    return out


def text(st: StepTimes, env: Env, inputs: dict) -> str:
    m, lay, c = st.model, st.layout, env.cluster
    lines = [f"flashoverlap-plan: {LABEL}",
             f"model   h={m.hidden} ffn={m.ffn} heads={m.heads}/{m.groups} head_dim={m.head_dim} s={m.seq} "
             f"mbs={m.micro_batch} layers={m.layers} experts={m.experts} {env.dtype}"
             f"{' swiglu' if m.swiglu else ''}{' recompute' if m.recompute else ''}",
             f"layout  TP={lay.tp}{' (SP)' if lay.sequence_parallel else ' (no SP)'} PP={lay.pp} CP={lay.cp} "
             f"EP={lay.ep} DP={lay.dp} on {c.world} x {c.gpu.name} ({c.gpus_per_node}/node over {c.intra.name}, "
             f"{c.nodes} node(s) over {c.inter.name} x{c.nics_per_node}); GEMM slowdown beside a transfer "
             f"{c.slowdown:.2f}",
             "", "one layer, one micro-batch, forward+backward (ms):",
             f"{'site':8} {'stock':>9} {'choice':>12} {'ours':>9}   why"]
    for name, site in list(st.layer.sites.items()) + list(st.layer.extras.items()):
        lines.append(f"{name:8} {_ms(site.stock):>9} {site.variant:>12} {_ms(site.time):>9}   "
                     f"{why(site, _group_size(name, st))}")
    lt = st.layer
    lines += [f"layer    {_ms(lt.total(True)):>9} {'':>12} {_ms(lt.total(False)):>9}   (attention + elementwise "
              f"{_ms(lt.fixed)} ms in both)", ""]
    stock, ours = st.step(True), st.step(False)
    lines += [f"training step: stock {stock:.3f} s, --flash-overlap {ours:.3f} s "
              f"({(ours - stock) / stock * 100:+.1f} %); {st.microbatches} micro-batch(es), stage "
              f"{_ms(st.stage(True))} -> {_ms(st.stage(False))} ms",
              f"DP reduce-scatter (last micro-batch): stock buckets exposed {_ms(st.dp_stock.exposed)} ms (backward "
              f"{st.dp_stock.extra * 1e3:+.3f} ms under them); ours dp.fuse={'all' if st.dp_fuse else 'none'}: exposed "
              f"{_ms(st.dp_ours.exposed)} ms (backward {st.dp_ours.extra * 1e3:+.3f} ms): "
              f"{'the wgrad rings hide more than they cost' if st.dp_fuse else 'rings in the wgrad would cost more'}"]
    if st.decode is not None:
        d = st.decode
        best = d.best("flash")
        lines.append(f"decode all-reduce [1, {inputs.get('decode_batch', 1)}, {m.hidden}] over TP={lay.tp}: NCCL "
                     f"{d.time('reference') * 1e6:.1f} us, ours {best[0].split(':')[1]} {best[1] * 1e6:.1f} us -> "
                     f"{d.choice()} (two per layer per token)")
    return "\n".join(lines)
