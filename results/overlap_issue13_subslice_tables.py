"""Regenerates the tables of results/overlap_issue13_subslice.md from its two raw JSON files, each row named by what
it ran (`flash` = c=1, the automatic choice now). Usage: PYTHONPATH=. python results/overlap_issue13_subslice_tables.py
results/overlap_issue13_subslice_point_raw.json results/overlap_issue13_subslice_sweeps_raw.json"""
import json, sys
from megatron_flashoverlap.bench import report
from megatron_flashoverlap.bench.estimator import speedup

RENAME = {"flash": "flash c=2", "flash c=1": "flash"}  # at the measured commit "flash" was automatic = c=2


def load(path):
    d = json.load(open(path))
    for run in d["seq_runs"] + d["rate_runs"]:
        run["config"]["methods"] = [RENAME.get(m, m) for m in run["config"]["methods"]]
        for r in run["rows"]:
            r["method"] = RENAME.get(r["method"], r["method"])
    return d


def versus_c1(runs):
    out = ["| link | block | seq | c=2 vs c=1 block time [90% ci] | c=4 vs c=1 [90% ci] |", "|---|---|---|---|---|"]
    for run in runs:
        rows = {(r["kind"], r["mode"], r["seq"], r["method"]): r for r in run["rows"]}
        for (kind, mode, seq, m), r in sorted(rows.items(), key=lambda kv: (kv[0][1], kv[0][2])):
            if m != "flash":
                continue
            cells = []
            for other in ("flash c=2", "flash c=4"):
                s = speedup(r["samples"], rows[(kind, mode, seq, other)]["samples"])
                tag = "win" if s["win"] else ("loss" if s["loss"] else "tie")
                cells.append(f"{s['ratio']:.2f}x [{s['ci'][0]:.2f}-{s['ci'][1]:.2f}] {tag}")
            out.append(f"| {run['rate']} | {kind} {mode} | {seq} | " + " | ".join(cells) + " |")
    return out


def section(d, title):
    runs = d["seq_runs"] + d["rate_runs"]
    md = [f"## {title}", ""]
    for run in runs:
        md += [f"### {report.header(run)}", "", report.table(run), ""]
    md += ["Verdict of `flash` (= c=1, the automatic choice now):", ""] + report.VERDICT_HEAD
    for run in runs:
        for mode in ("fwd", "fwd+bwd"):
            md += report.verdict(run, "mlp", mode)
    md += ["", "Sub-chunks against one transfer per hop (ratio > 1: the sub-chunked ring is faster; a win or "
           "loss only where the 90 % interval excludes 1.0):", ""] + versus_c1(runs)
    md += ["", "Summary of `flash`:", ""] + report.summary(runs) + [""]
    return md


if __name__ == "__main__":
    issue, sweep = load(sys.argv[1]), load(sys.argv[2])
    md = section(issue, "The issue's point: S = 2048, h = 1024, n = 8192 (per-rank width 4096), 2 gbit/s, 2 ranks")
    md += section(sweep, "The sequence sweep (4 gbit/s) and the link-rate sweep (s = 1024), h = 256, width 512")
    print("\n".join(md))
