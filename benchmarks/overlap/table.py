"""The overlap benchmark's writers: markdown tables, PNG plots, Chrome-trace / Perfetto JSON timelines from
worker outputs (benchmarks/overlap/worker.py).

A run = the worker's JSON for one link rate, plus "rate" (tc rate or "unshaped") added by the launcher.
hop_chunk_section(runs): every `flash c=N` row (N row sub-chunks per hop, ops/tp_sp/plain.py
hop_chunks_for) against `flash` (c = 1, the automatic choice) at the same point: the measured basis of the
automatic choice.
"""
from __future__ import annotations

import json

from benchmarks.harness.blocks import Shape, method_by_name
from benchmarks.overlap.costmodel import calibrate, predict, sites
from benchmarks.harness.estimator import speedup
from benchmarks.harness.verdict import HEAD as VERDICT_HEAD, speedup_text, summary, verdict  # noqa: F401  (faces)

COLS = "| block | mode | seq | method | block ms (min-max) | compute ms | comm ms | exposed ms | " \
       "hidden [90% ci] | to bound [90% ci] | vs stock [90% ci] | model ms* |"


def _shape(run: dict, seq: int) -> Shape:
    c = run["config"]
    return Shape(seq, c["batch"], c["hidden"], c["width"], c.get("head_dim", 64))


def probes_at(run: dict, kind: str, seq: int) -> dict:
    """The run's probes calibrated on the stock forward row of (kind, seq) (see costmodel.calibrate)."""
    st = next((r for r in run["rows"] if r["kind"] == kind and r["seq"] == seq and r["method"] == "stock"
               and r["mode"] == "fwd"), None)
    if st is None:
        return run["probes"]
    return calibrate(run["probes"], kind, _shape(run, seq), run["world"], st["compute"], st["comm"])


def rows_with_model(run: dict) -> list[dict]:
    """The run's rows, each with `model` (predicted seconds) and `speedup` (stock block / this block)."""
    stock = {(r["kind"], r["seq"], r["mode"]): r["samples"] for r in run["rows"] if r["method"] == "stock"}
    out = []
    for r in run["rows"]:
        m = method_by_name(r["method"])
        pred = predict(r["kind"], _shape(run, r["seq"]), m, probes_at(run, r["kind"], r["seq"]), run["world"],
                       r["mode"])
        base = stock.get((r["kind"], r["seq"], r["mode"]))
        out.append({**r, "model": pred, "speedup": speedup(base, r["samples"]) if base else None})
    return out


def table(run: dict, seqs=None) -> str:
    """One markdown table of a run (all rows, or only the given sequence lengths)."""
    lines = [COLS, "|" + "---|" * 12]
    for r in rows_with_model(run):
        if seqs and r["seq"] not in seqs:
            continue
        lo, hi = r["spread"]
        (hl, hh), (bl, bh), sp = r["hidden_ci"], r["bound_ci"], r["speedup"]
        vs = f"{sp['ratio']:.2f}x [{sp['ci'][0]:.2f}-{sp['ci'][1]:.2f}]" if sp else "-"
        lines.append(f"| {r['kind']} | {r['mode']} | {r['seq']} | {r['method']} | {r['block'] * 1e3:.1f} "
                     f"({lo * 1e3:.1f}-{hi * 1e3:.1f}) | {r['compute'] * 1e3:.1f} | {r['comm'] * 1e3:.1f} | "
                     f"{r['exposed'] * 1e3:.1f} | {r['hidden'] * 100:.0f}% [{hl * 100:.0f}-{hh * 100:.0f}] | "
                     f"{r['bound']:.2f}x [{bl:.2f}-{bh:.2f}] | {vs} | {r['model'] * 1e3:.1f} |")
    return "\n".join(lines)


def megatron_table(run: dict) -> str:
    """Block times of the real Megatron MLP: stock spec vs ours per method (block only)."""
    rows = run.get("megatron_rows") or []
    if not rows:
        return ""
    by = {(r["method"], r["mode"]): r for r in rows}
    lines = ["| Megatron MLP (s=%d) | fwd ms (min-max) | fwd+bwd ms (min-max) | fwd vs stock [90%% ci] | "
             "fwd+bwd vs stock [90%% ci] |" % rows[0]["seq"], "|---|---|---|---|---|"]
    for name in dict.fromkeys(r["method"] for r in rows):
        f, fb = by[(name, "fwd")], by[(name, "fwd+bwd")]
        sf, sfb = (speedup(by[("megatron stock", m)]["samples"], by[(name, m)]["samples"]) for m in ("fwd", "fwd+bwd"))
        label = f"{name} (ran {f['picked']})" if f.get("picked") else name
        lines.append(f"| {label} | {f['block'] * 1e3:.1f} ({f['spread'][0] * 1e3:.1f}-{f['spread'][1] * 1e3:.1f}) | "
                     f"{fb['block'] * 1e3:.1f} ({fb['spread'][0] * 1e3:.1f}-{fb['spread'][1] * 1e3:.1f}) | "
                     f"{_ratio(sf)} | {_ratio(sfb)} |")
    return "\n".join(lines)


def _ratio(s: dict) -> str:
    return f"{s['ratio']:.2f}x [{s['ci'][0]:.2f}-{s['ci'][1]:.2f}]"


def header(run: dict) -> str:
    c, p = run["config"], run["probes"]
    best = max(p["gemm_flops"].values())
    return (f"link {run['rate']} (measured {p['link_Bps'] / 2 ** 20:.1f} MiB/s per rank under load), "
            f"P={run['world']}, b={c['batch']}, h={c['hidden']}, per-rank width {c['width']}, fp32, "
            f"{c['repeats']} repeats (medians; block spread min-max), GEMM up to {best / 1e9:.1f} GFLOP/s/rank"
            + (f" on {run['cpus']} CPUs" if "cpus" in run else ""))


def model_error(runs: list[dict]) -> str:
    """One line: how far the cost model's predictions fall from the measured medians."""
    import statistics
    errs = [abs(r["model"] / r["block"] - 1.0) for run in runs for r in rows_with_model(run)]
    return (f"Cost model vs measurement over {len(errs)} rows: median |predicted/measured - 1| = "
            f"{100 * statistics.median(errs):.0f}%, "
            f"90th percentile {100 * sorted(errs)[int(0.9 * (len(errs) - 1))]:.0f}%")


def site_lines(run: dict, seq: int) -> list[str]:
    methods = [method_by_name(n) for n in run["config"]["methods"]]
    return [f"- {reason}" for _, reason in sites(_shape(run, seq), probes_at(run, "mlp", seq), run["world"], methods)]


def _chunked(run: dict) -> list[str]:
    return [m for m in run["config"]["methods"] if m.startswith("flash c=") and m != "flash c=1"]


def hop_chunk_section(runs: list[dict]) -> list[str]:
    """Markdown lines: `flash c=N` against `flash` (c = 1) per point, ratio > 1 where the sub-chunked ring is
    faster (a win or LOSS only where the 90 % interval excludes 1.0); [] where no run has a c=N row."""
    chunked = list(dict.fromkeys(m for run in runs for m in _chunked(run)))
    if not chunked:
        return []
    names = [m.split("flash ", 1)[1] for m in chunked]
    cols = [f"{names[0]} vs c=1 block time [90% ci]"] + [f"{n} vs c=1 [90% ci]" for n in names[1:]]
    out = ["", "## Hop sub-chunks: `flash c=N` against `flash` (one transfer per hop, the automatic choice)", "",
           "| link | block | seq | " + " | ".join(cols) + " |", "|---|---|---|" + "---|" * len(cols)]
    for run in runs:
        rows = {(r["kind"], r["mode"], r["seq"], r["method"]): r for r in run["rows"]}
        for (kind, mode, seq, m), r in sorted(rows.items(), key=lambda kv: (kv[0][1], kv[0][2])):
            if m != "flash":
                continue
            cells = [speedup_text(speedup(r["samples"], rows[(kind, mode, seq, c)]["samples"]))
                     if (kind, mode, seq, c) in rows else "-" for c in chunked]
            out.append(f"| {run['rate']} | {kind} {mode} | {seq} | " + " | ".join(cells) + " |")
    return out


def plot(runs: list[dict], path: str, kind: str = "mlp") -> None:
    """Hidden fraction and distance to bound vs sequence length, one line per method; a column per mode,
    a row pair per link rate."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = ("fwd", "fwd+bwd")
    fig, axes = plt.subplots(2 * len(runs), 2, figsize=(11, 4.2 * len(runs)), squeeze=False)
    for i, run in enumerate(runs):
        for j, mode in enumerate(modes):
            for name in run["config"]["methods"]:
                rs = sorted((r for r in run["rows"] if r["kind"] == kind and r["mode"] == mode
                             and r["method"] == name), key=lambda r: r["seq"])
                seqs = [r["seq"] for r in rs]
                style = "-o" if name.startswith("flash") else ("--s" if name == "stock" else ":^")
                axes[2 * i][j].plot(seqs, [100 * r["hidden"] for r in rs], style, label=name)
                axes[2 * i + 1][j].plot(seqs, [r["bound"] for r in rs], style, label=name)
            axes[2 * i][j].set_title(f"{kind} {mode}, link {run['rate']}: hidden communication")
            axes[2 * i][j].set_ylabel("hidden %")
            axes[2 * i + 1][j].set_title(f"{kind} {mode}, link {run['rate']}: block / max(compute, comm)")
            axes[2 * i + 1][j].axhline(1.1, color="grey", lw=0.8, ls="--")
            axes[2 * i + 1][j].set_ylabel("distance to bound (x)")
            for ax in (axes[2 * i][j], axes[2 * i + 1][j]):
                ax.set_xscale("log", base=2)
                ax.set_xlabel("sequence length (tokens)")
                ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _x(name, cat, start, end, pid, tid, t0, **args) -> dict:
    return {"name": name, "cat": cat, "ph": "X", "ts": (start - t0) * 1e6, "dur": max(0.0, end - start) * 1e6,
            "pid": pid, "tid": tid, "args": args}


def _comm_intervals(events) -> list[tuple[str, float, float]]:
    """Pair each `post step i` with the end of the next `wait step i`: the step is in flight between."""
    out = []
    for j, (what, label, start, _) in enumerate(events):
        if what != "post":
            continue
        end = next((e[3] for e in events[j + 1:] if e[0] == "wait" and e[1] == label), None)
        if end is not None:
            out.append((label, start, end))
    return out


def trace(traces: list[dict], path: str) -> None:
    """Chrome trace (chrome://tracing, ui.perfetto.dev): a process per method|mode, three tracks per rank:
    operators, compute slices (+ exposed waits), transfers in flight."""
    events = []
    for pid, key in enumerate(traces[0]):
        t0 = min(min(s[1] for s in tr[key]["spans"]) for tr in traces)
        events.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": key}})
        for rank, tr in enumerate(traces):
            base = 10 * rank
            for tid, name in ((base, f"rank {rank} operators"), (base + 1, f"rank {rank} compute"),
                              (base + 2, f"rank {rank} comm")):
                events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}})
            events += [_x(lbl, "op", a, b, pid, base, t0) for lbl, a, b in tr[key]["spans"]]
            for what, lbl, a, b in tr[key]["events"]:
                if what in ("compute", "wait"):
                    events.append(_x(f"{what} {lbl}" if what == "wait" else f"slice {lbl}", what, a, b, pid,
                                     base + 1, t0))
            events += [_x(f"{lbl} in flight", "comm", a, b, pid, base + 2, t0)
                       for lbl, a, b in _comm_intervals(tr[key]["events"])]
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)


def plot_rates(runs: list[dict], seq: int, path: str, kind: str = "mlp", mode: str = "fwd") -> None:
    """Hidden fraction and distance to bound vs the link rate (runs labelled with a tc rate)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    pick = lambda run, name: next(r for r in run["rows"] if r["kind"] == kind and r["mode"] == mode  # noqa: E731
                                  and r["seq"] == seq and r["method"] == name)
    from benchmarks.harness.netns import parse_rate
    ratio = [parse_rate(run["rate"]) / 1e9 for run in runs]  # x: the nominal tbf rate (deterministic)
    order = sorted(range(len(runs)), key=lambda i: ratio[i])
    for name in runs[0]["config"]["methods"]:
        style = "-o" if name.startswith("flash") else ("--s" if name == "stock" else ":^")
        xs = [ratio[i] for i in order]
        axes[0].plot(xs, [100 * pick(runs[i], name)["hidden"] for i in order], style, label=name)
        axes[1].plot(xs, [pick(runs[i], name)["bound"] for i in order], style, label=name)
    for ax, yl in zip(axes, ("hidden %", "distance to bound (x)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tbf rate on lo, Gbit/s (slower link = more communication per GEMM)")
        ax.set_ylabel(yl)
        ax.grid(alpha=0.3)
    axes[1].axhline(1.1, color="grey", lw=0.8, ls="--")
    axes[0].set_title(f"{kind} {mode}, s={seq}: link rate sweep ({', '.join(r['rate'] for r in runs)})")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def timeline_png(traces: list[dict], path: str, mode: str = "fwd") -> None:
    """The trace drawn as bars: per method a row per rank with compute slices, exposed waits and the
    transfers in flight (the tail is the wait after the last slice)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [k for k in traces[0] if k.endswith("|" + mode)]
    fig, axes = plt.subplots(len(keys), 1, figsize=(11, 1.6 * len(keys) * len(traces)), squeeze=False)
    colors = {"op": "#cccccc", "compute": "#4c72b0", "wait": "#dd4444", "comm": "#55a868"}
    for ax, key in zip(axes[:, 0], keys):
        t0 = min(min(s[1] for s in tr[key]["spans"]) for tr in traces)
        for rank, tr in enumerate(traces):
            y = 3 * (len(traces) - 1 - rank)
            bars = [("op", y + 2, a, b) for _, a, b in tr[key]["spans"]]
            bars += [(w, y + 1, a, b) for w, _, a, b in tr[key]["events"] if w in ("compute", "wait")]
            bars += [("comm", y, a, b) for _, a, b in _comm_intervals(tr[key]["events"])]
            for what, yy, a, b in bars:
                ax.barh(yy, (b - a) * 1e3, left=(a - t0) * 1e3, height=0.8, color=colors[what],
                        edgecolor="white", linewidth=0.5)
        ax.set_yticks([3 * (len(traces) - 1 - r) + i for r in range(len(traces)) for i in range(3)],
                      [f"r{r} {n}" for r in range(len(traces)) for n in ("in flight", "slices/waits", "operators")],
                      fontsize=7)
        ax.set_title(f"{key}: blue = GEMM slice, red = exposed wait, green = transfer in flight", fontsize=9)
    axes[-1, 0].set_xlabel("ms since block start")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
