"""The decode all-reduce benchmark's table and plot, from a calibration file (tools/calibrate_allreduce.py).

    tables = json.load(f)["tables"]     one per (world_size, local_world_size, backend, dtype)
    markdown(tables) -> per layout: | size | stock | ring | recursive doubling | hierarchical | best ours |
                                    speedup vs stock |   (ms, medians over rounds)
    plot(tables, path)               latency vs message size, a panel per layout

Stock is the collective's own all-reduce: the column `reference_us` (calibration tables written before the
algorithm word "reference" call it `stock_us`; ops/all_reduce/select.py reads both the same way).
"""
from __future__ import annotations

OURS = ("ring", "recursive_doubling", "hierarchical")


def stock_us(row: dict) -> float:
    return row["reference_us"] if "reference_us" in row else row["stock_us"]


def _fmt_bytes(n: int) -> str:
    return f"{n >> 20} MB" if n >= 1 << 20 else f"{n >> 10} KB"


def _title(t: dict) -> str:
    return f"{t['world_size']} ranks = {t['world_size'] // t['local_world_size']} nodes x {t['local_world_size']}"


def markdown(tables: list[dict]) -> str:
    lines = []
    for t in tables:
        lines += [f"**{_title(t)}** ({t['dtype']}, median of {t['iters']} rounds, ms; {t['note']}; "
                  f"{t['measured_at'][:10]})", "",
                  "| size | stock | ring | recursive doubling | hierarchical | best ours | speedup vs stock |",
                  "|---|---|---|---|---|---|---|"]
        for r in t["rows"]:
            ours = {a: r[f"{a}_us"] for a in OURS}
            best = min(ours, key=ours.get)
            cells = " | ".join(f"{us / 1e3:.2f}" for us in (stock_us(r), *ours.values()))
            lines.append(f"| {_fmt_bytes(r['bytes'])} | {cells} | {best} | {stock_us(r) / ours[best]:.2f}x |")
        lines.append("")
    return "\n".join(lines)


def plot(tables: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(tables), figsize=(6 * len(tables), 4.5), squeeze=False)
    for ax, t in zip(axes[0], tables):
        xs = [r["bytes"] for r in t["rows"]]
        ax.plot(xs, [stock_us(r) / 1e3 for r in t["rows"]], marker="o", label="stock")
        for a in OURS:
            ax.plot(xs, [r[f"{a}_us"] / 1e3 for r in t["rows"]], marker="o", label=a)
        ax.set(xscale="log", yscale="log", xlabel="message size (bytes)", ylabel="latency (ms, median)",
               title=_title(t).replace(" = ", ": "))
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
