"""FP8 on the wire: bytes per all-gather site and the all-gather ring's transfer time, FP8 against bf16, over an
emulated (tbf-shaped) link. FP8 compute is emulated on CPU (torch._scaled_mm, ~1000x slower than fp32), so this
measures what transfers, not GEMMs.

    sudo .venv/bin/python benchmarks/fp8/run.py                    # 1gbit, P = 2 and 4 -> out/fp8/fp8.md
    .venv/bin/python benchmarks/fp8/run.py --unshaped --rounds 3   # no root: host loopback, labelled unshaped

What each row measures: benchmarks/fp8/rows.py. A time is the median over interleaved rounds of the max over
ranks; spread = (max - min) / min over the rounds. "bf16 / fp8" is the ratio of the medians with its 90 %
bootstrap interval over rounds (harness/estimator.py `speedup`) and the range of the per-round ratios (both
variants of a round run back to back): a ratio is claimed only where both lie above it.
"""
from __future__ import annotations

import contextlib
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if __name__ == "__main__":  # run as a script: the checkout's root on the path, not this folder
    sys.path[0] = ROOT

from benchmarks.harness.cli import before_run, out_dir, parser  # noqa: E402
from benchmarks.harness.estimator import speedup  # noqa: E402
from benchmarks.harness.launch import command_line, run_ranks, write_text  # noqa: E402
from benchmarks.harness.netns import shaped_namespace  # noqa: E402

PASSES = {("column", "forward"): "qkv, fc1 forward: AG(x)", ("column", "backward"): "qkv, fc1 backward: AG(x), RS(dx)",
          ("row", "forward"): "proj, fc2 forward: RS(y)", ("row", "backward"): "proj, fc2 backward: AG(dy)"}
PAIRS = (("ring bf16", "ring fp8"), ("ring bf16", "ring fp8 + cast"), ("stock bf16", "stock fp8"))


def parse(argv=None):
    p = parser(__doc__, "fp8")
    p.add_argument("--rate", default="1gbit", help="tbf rate of the namespace's loopback")
    p.add_argument("--burst", default="512kb")
    p.add_argument("--worlds", default="2,4", help="group sizes (comma list)")
    p.add_argument("--seq", type=int, default=8192, help="full sequence length s of the ring (a shard: s/P rows)")
    p.add_argument("--sites-seq", type=int, default=512, help="s of the operators' byte count (their FP8 GEMMs run "
                   "on CPU at ~25 M multiply-adds a second; the FP8 / bf16 ratio does not depend on s)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=7, help="interleaved rounds (one warm-up round more)")
    p.add_argument("--unshaped", action="store_true", help="run on the host loopback (no root needed), labelled")
    p.add_argument("--out", default=os.path.join(out_dir("fp8"), "fp8.md"), help="the markdown (default out/fp8/fp8.md)")
    return p.parse_args(argv)


def _ms(seconds: list) -> str:
    med, lo, hi = statistics.median(seconds), min(seconds), max(seconds)
    return f"{med * 1e3:.1f} | {(hi - lo) / lo:.0%}"


def sites_table(out: dict) -> list[str]:
    md = ["| site: pass | AG bytes bf16 | AG bytes FP8 | FP8 / bf16 | RS bytes bf16 | RS bytes FP8 |", "|---|---|---|---|---|---|"]
    for r in out["sites"]:
        b, f = r["bf16"], r["fp8"]
        ratio = f"{f['ag'] / b['ag']:.4f}" if b["ag"] else "-"
        md.append(f"| {PASSES[(r['layer'], r['pass'])]} | {b['ag']} | {f['ag']} | {ratio} | {b['rs']} | {f['rs']} |")
    return md


def ring_table(out: dict) -> list[str]:
    ring = out["ring"]
    md = ["| variant | bytes sent per rank | median ms | spread |", "|---|---|---|---|"]
    md += [f"| {name} | {v['bytes'] or 'a collective: no send op'} | {_ms(v['seconds'])} |" for name, v in ring.items()]
    md += ["", "| bf16 / fp8 | ratio of medians [90 % ci] | per-round ratios: min, max |", "|---|---|---|"]
    for slow, fast in PAIRS:
        a, b = ring[slow]["seconds"], ring[fast]["seconds"]
        est, per_round = speedup(a, b), [x / y for x, y in zip(a, b)]
        md.append(f"| {slow} / {fast} | {est['ratio']:.2f}x [{est['ci'][0]:.2f}, {est['ci'][1]:.2f}] | "
                  f"{min(per_round):.2f}, {max(per_round):.2f} |")
    return md


def report(runs: list, a, cmd: str) -> str:
    link = "unshaped (host loopback)" if a.unshaped else f"loopback tbf {a.rate}, burst {a.burst}"
    md = ["# FP8 on the wire", "", f"`{cmd.strip()}`", "",
          f"Ring: s = {a.seq}, b = {a.batch}, h = {a.hidden} (a shard [s/P, b, h]); operators' bytes: s = "
          f"{a.sites_seq}; {link}, {a.rounds} rounds, gloo, {os.cpu_count()} CPUs.", ""]
    for out in runs:
        md += [f"## P = {out['world']}", "", "Bytes one rank sends per pass (FP8: hybrid tensorwise; RS on the fp32 wire):", ""]
        md += sites_table(out) + ["", "The all-gather ring's transfer time:", ""] + ring_table(out) + [""]
    return "\n".join(md)


def main(argv=None) -> int:
    a = parse(argv)
    if (code := before_run(a, None, "fp8/run.py")) is not None:
        return code
    cfg = {"seq": a.seq, "sites_seq": a.sites_seq, "batch": a.batch, "hidden": a.hidden, "rounds": a.rounds}
    runs = []
    with (contextlib.nullcontext(None) if a.unshaped else shaped_namespace(a.rate, a.burst)) as ns:
        for world in (int(w) for w in a.worlds.split(",")):
            runs.append(run_ranks("benchmarks.fp8.rows:main", world, args=(cfg,), ns=ns, timeout=1800)[0])
    text = report(runs, a, command_line("fp8/run.py", argv))
    if a.out:
        write_text(a.out, text + "\n")  # prints it too
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
