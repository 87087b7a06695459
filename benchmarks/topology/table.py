"""The decode all-reduce benchmark's table and plot, from a calibration file (tools/calibrate_allreduce.py).

    tables = json.load(f)["tables"]     one per (world_size, local_world_size, backend, dtype)
    markdown(tables) -> per layout: | size | stock | ring | recursive doubling | hierarchical |
                                    hierarchical pipelined | hierarchical hd | best ours | auto ran | auto vs stock |
    plot(tables, path)               latency vs message size, a panel per layout

Stock is the collective's own all-reduce: the column `reference_us` (calibration tables written before the
algorithm word "reference" call it `stock_us`; ops/all_reduce/select.py reads both the same way).
"auto ran" is what the start-up calibration chose at that size (the row's "auto_ran" where the file records it,
else the table's "startup" entry read by today's rule, select.best_at; "reference" where ours did not win
there); "auto vs stock" is median(stock) / median(auto) over the same interleaved rounds with its bootstrap
interval (benchmarks/harness/estimator.py speedup): win / loss where the interval excludes 1.0, tie otherwise.
A column a table lacks (an older file) prints "-".
"""
from __future__ import annotations

from benchmarks.harness.estimator import LEVEL, speedup
from megatron_flashoverlap.ops.all_reduce.select import best_at
from megatron_flashoverlap.schedules import ALL_REDUCE_SCHEDULES

OURS = ALL_REDUCE_SCHEDULES  # every exchange word, in the table's column order


def stock_us(row: dict) -> float:
    return row["reference_us"] if "reference_us" in row else row["stock_us"]


def _stock_rounds(row: dict):
    return row.get("reference_rounds_us", row.get("stock_rounds_us"))


def _fmt_bytes(n: int) -> str:
    return f"{n >> 20} MB" if n >= 1 << 20 else f"{n >> 10} KB"


def _title(t: dict) -> str:
    return f"{t['world_size']} ranks = {t['world_size'] // t['local_world_size']} nodes x {t['local_world_size']}"


def _auto_cells(t: dict, r: dict) -> str:
    """'auto ran | auto vs stock' for one row ('- | -' where the table has no auto column)."""
    ran = r.get("auto_ran") or ((best_at(t["startup"], r["bytes"]) or "reference") if "startup" in t else "-")
    if "auto_rounds_us" not in r or _stock_rounds(r) is None:
        return f"{ran} | -"
    s = speedup(_stock_rounds(r), r["auto_rounds_us"])
    verdict = "win" if s["win"] else "loss" if s["loss"] else "tie"
    return f"{ran} | {s['ratio']:.2f}x [{s['ci'][0]:.2f}, {s['ci'][1]:.2f}] {verdict}"


def _row(t: dict, r: dict) -> str:
    ours = {a: r[f"{a}_us"] for a in OURS if f"{a}_us" in r}
    best = min(ours, key=ours.get)
    cells = " | ".join(f"{r[f'{a}_us'] / 1e3:.2f}" if f"{a}_us" in r else "-" for a in OURS)
    return (f"| {_fmt_bytes(r['bytes'])} | {stock_us(r) / 1e3:.2f} | {cells} | {best} {stock_us(r) / ours[best]:.2f}x"
            f" | {_auto_cells(t, r)} |")


def markdown(tables: list[dict]) -> str:
    lines = []
    for t in tables:
        lines += [f"**{_title(t)}** ({t['dtype']}, median of {t['iters']} rounds, ms; {t['note']}; auto vs stock: "
                  f"ratio of medians [{LEVEL:.0%} bootstrap interval over rounds])", "",
                  f"| size | stock | {' | '.join(a.replace('_', ' ') for a in OURS)} "
                  "| best ours (vs stock) | auto ran | auto vs stock |",
                  "|---" * (len(OURS) + 5) + "|"]
        lines += [_row(t, r) for r in t["rows"]]
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
        for a in OURS + ("auto",):
            if all(f"{a}_us" in r for r in t["rows"]):
                ax.plot(xs, [r[f"{a}_us"] / 1e3 for r in t["rows"]], marker="o", label=a,
                        linestyle="--" if a == "auto" else "-")
        ax.set(xscale="log", yscale="log", xlabel="message size (bytes)", ylabel="latency (ms, median)",
               title=_title(t).replace(" = ", ": "))
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
