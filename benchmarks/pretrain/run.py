"""End to end: Megatron's own training loop (the project entry) on the shaped link, stock vs --flash-overlap
vs the slicing config, TP=2 + SP on 2 CPU ranks.

    sudo .venv/bin/python benchmarks/pretrain/run.py --rate 1gbit --rounds 5    # out/pretrain/pretrain.md + _raw.json
    .venv/bin/python benchmarks/pretrain/run.py --unshaped --quick               # no root: host loopback, labelled
    .venv/bin/python benchmarks/pretrain/run.py --render benchmarks/pretrain/data/line_rate_raw.json  # tables again

Every round launches `python -m megatron_flashoverlap.pretrain_gpt --cpu ...` once per arm (order rotated
per round: runtime/timing.py) inside one network namespace whose loopback is tbf-shaped to --rate (the
stock@unshaped arm: the same namespace with its qdisc removed). A run's sample is the median `elapsed time per
iteration` Megatron logs after --warmup iterations; each arm's speedup over stock is benchmarks/harness/estimator.py's
(median ratio, 90 % bootstrap interval over rounds; a win only where the interval excludes 1.0). Same seed
and mock data in every arm: the lm loss of each is compared with stock's. Arms, parsing: benchmarks/pretrain/rows.py.
Any arm as `<arm>+heap` runs with glibc's heap kept (harness/launch.py HEAP; the other arms with glibc's
defaults) and is compared with `stock+heap` where the run has it: `--arms stock+heap,auto+b60+heap`.
`--profile`: one more run per shaped arm under Megatron's torch profiler (rank 0), cut into categories
(benchmarks/pretrain/profiling.py): where the iteration goes.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if __name__ == "__main__":  # run as a script: the checkout's root on the path, not this folder
    sys.path[0] = ROOT

from benchmarks.harness.cli import before_run, out_dir, parser  # noqa: E402
from benchmarks.harness.launch import STOCK_RS_LABEL, add_stock_rs_arg, command_line, run_ranks, write_text  # noqa: E402
from benchmarks.harness.netns import shaped_namespace  # noqa: E402
from benchmarks.pretrain.profiling import categorize, profile_argv, profile_table, trace_path  # noqa: E402
from benchmarks.pretrain.table import breakdown_table, loss_table, reference, summarize, table  # noqa: E402
from benchmarks.pretrain.rows import ARMS, base_arm, heap_kept, entry_argv, merge, run_stat  # noqa: E402
from megatron_flashoverlap.runtime.timing import interleaved  # noqa: E402

RANK = "benchmarks.pretrain.rank"


def parse(argv=None) -> argparse.Namespace:
    p = parser(__doc__, "pretrain")
    p.add_argument("--rate", default="1gbit", help="tbf rate of the namespace's loopback")
    p.add_argument("--burst", default="512kb")
    p.add_argument("--rounds", type=int, default=5, help="0 with --profile: the profiled runs only")
    p.add_argument("--iters", type=int, default=8, help="training iterations per run")
    p.add_argument("--warmup", type=int, default=2, help="first iterations of a run left out of its median")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--mbs", type=int, default=1, help="micro-batch size (= global batch: one micro-batch)")
    p.add_argument("--vocab", type=int, default=128)
    p.add_argument("--attention-dropout", type=float, default=None,
                   help="Megatron's --attention-dropout in every arm (default: Megatron's, 0.1)")
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma list among {list(ARMS)}")
    p.add_argument("--unshaped", action="store_true", help="host loopback, no namespace (no root), labelled")
    p.add_argument("--quick", action="store_true", help="tiny model, 1 round (smoke test)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per run before it is stopped")
    p.add_argument("--profile", action="store_true",
                   help="after the rounds, one more run per shaped arm with Megatron's torch profiler on rank 0 "
                        "(iterations warmup+1 .. warmup+3, not timed): the breakdown table")
    p.add_argument("--logs", default=None, help="folder for every rank's whole output (default: none kept)")
    add_stock_rs_arg(p)
    p.add_argument("--out", default=os.path.join(out_dir("pretrain"), "pretrain.md"),
                   help="the markdown (its samples beside it: X.md -> X_raw.json; default out/pretrain/pretrain.md)")
    p.add_argument("--render", metavar="RAW", help="rewrite the tables of the markdown beside RAW (X_raw.json -> "
                   "X.md) from its samples (nothing is run; the title, command and setting lines are kept)")
    a = p.parse_args(argv)
    if a.quick:
        a.layers, a.hidden, a.heads, a.seq, a.iters, a.warmup, a.rounds = 2, 64, 4, 64, 4, 1, 1
    return a


def _set_link(ns, arm: str, a) -> None:
    """The namespace's lo: tbf at --rate for a shaped arm, no root qdisc for an unshaped one."""
    if ns is None:
        return
    if ARMS[base_arm(arm)][1] == "rate":
        ns.shape_lo(a.rate, a.burst)
    else:
        with contextlib.suppress(subprocess.CalledProcessError):  # already without a qdisc
            ns.tc("qdisc", "del", "dev", "lo", "root")


def _variant(arm: str, a, ns, cfg: dict, runs: dict):
    """A runtime/timing.py variant: one run of `arm`, its merged parse kept in runs[arm]; -> its statistic."""
    def one() -> float:
        _set_link(ns, arm, a)
        log = os.path.join(os.path.abspath(a.logs), f"{arm}.round{len(runs[arm])}") if a.logs else "-"
        t0 = time.perf_counter()
        ranks = run_ranks([RANK, log, a.stock_rs, *entry_argv(arm, cfg)], 2, ns=ns, timeout=a.timeout,
                          heap=heap_kept(arm))
        runs[arm].append({**merge(ranks), "wall_s": time.perf_counter() - t0})
        stat = run_stat(runs[arm][-1], a.warmup)
        print(f"  {arm:15s} round {len(runs[arm]) - 1}: median iteration {stat * 1e3:.0f} ms "
              f"(run {runs[arm][-1]['wall_s']:.0f} s)", flush=True)
        return stat
    return one


def measure(a, cfg: dict, arms: list[str]) -> dict:
    """{arm: [merged parse per round]}: all arms interleaved, one namespace for the whole benchmark."""
    runs: dict = {arm: [] for arm in arms}
    if a.logs:
        os.makedirs(a.logs, exist_ok=True)
    with (contextlib.nullcontext(None) if a.unshaped else shaped_namespace(None)) as ns:
        variants = {arm: _variant(arm, a, ns, cfg, runs) for arm in arms}
        interleaved(variants, a.rounds, warmup=0, rotate=True)
    return runs


def profile(a, cfg: dict, arms: list[str]) -> dict:
    """{arm: benchmarks/pretrain/profiling.py categorize of one profiled run} for the shaped arms (one namespace)."""
    folder = os.path.abspath(a.logs or tempfile.mkdtemp(prefix="pretrain-profile-"))
    out = {}
    with (contextlib.nullcontext(None) if a.unshaped else shaped_namespace(None)) as ns:
        for arm in (x for x in arms if ARMS[base_arm(x)][1] == "rate"):
            _set_link(ns, arm, a)
            where = os.path.join(folder, f"{arm}.profile")
            flags = profile_argv(where, a.warmup + 1, min(a.iters, a.warmup + 3))
            run_ranks([RANK, where, a.stock_rs, *entry_argv(arm, cfg), *flags], 2, ns=ns, timeout=a.timeout,
                      heap=heap_kept(arm))
            out[arm] = categorize(trace_path(where))
            print(f"  {arm:15s} profiled: {out[arm]['step_ms']:.0f} ms per iteration", flush=True)
    return out


def body(raw: dict) -> str:
    """The sections of the markdown from its raw JSON ({"config", "runs", "profiles"}): what --render rebuilds."""
    c = raw["config"]
    runs = {arm: [merge([p]) for p in parsed] for arm, parsed in raw.get("runs", {}).items()}  # JSON keys -> int
    s = summarize(runs, c["warmup"]) if runs else None
    md = []
    if s:
        md += ["## Iteration time", "", table(s, "unshaped" if c["unshaped"] else c["rate"]), "",
               "## Where the time goes (Megatron's timers, ms, max over ranks; medians over kept iterations, rounds)",
               "", breakdown_table(s), ""]
    if raw.get("profiles"):
        md += [f"## Rank 0's iteration by category (Megatron's torch profiler, one extra run per arm, iterations "
               f"{c['warmup'] + 2}-{min(c['iters'], c['warmup'] + 3)})", "",
               "The profiler slows every op: compare the columns, not with the timed runs; "
               "benchmarks/pretrain/profiling.py says what each category holds.", "",
               profile_table(raw["profiles"]), ""]
    if s:
        md += ["## lm loss per iteration (round 0 of each arm)", "", loss_table(s), ""]
    return "\n".join(md) + "\n"


def report(a, cmd: str, raw: dict) -> str:
    """The markdown: title, command, setting, then body(raw)."""
    link = "unshaped host loopback" if a.unshaped else f"tbf {a.rate} (burst {a.burst})"
    head = (f"Megatron pretrain() (project entry), GPT {a.layers} layers, hidden {a.hidden}, {a.heads} heads, "
            f"seq {a.seq}, micro-batch {a.mbs}, vocab {a.vocab}, fp32, "
            f"{'' if a.attention_dropout is None else f'attention dropout {a.attention_dropout}, '}"
            f"TP=2 + SP, 2 CPU ranks (gloo), {link}; "
            f"{a.rounds} rounds x {a.iters} iterations per arm, first {a.warmup} dropped; {STOCK_RS_LABEL[a.stock_rs]}")
    md = [f"# End-to-end training loop on the shaped link ({datetime.date.today()})", "", f"Command: `{cmd}`", "",
          head, ""]
    return "\n".join(md) + "\n" + body(raw)


def main(argv=None) -> int:
    a = parse(argv)
    if (code := before_run(a, body, "pretrain/run.py")) is not None:
        return code
    arms = [x for x in a.arms.split(",") if x]
    cfg = {"layers": a.layers, "hidden": a.hidden, "heads": a.heads, "seq": a.seq, "mbs": a.mbs,
           "iters": a.iters, "vocab": a.vocab, "attention_dropout": a.attention_dropout}
    for arm in arms:
        entry_argv(arm, cfg)  # an unknown arm fails here, before any run
    if a.rounds:
        reference(arms)  # and a run without stock or stock+heap to compare with
    if a.rounds == 0 and not a.profile:
        raise ValueError("--rounds 0 measures nothing: give --profile with it (a profile-only run)")
    runs = measure(a, cfg, arms) if a.rounds else {}
    profiles = profile(a, cfg, arms) if a.profile else {}
    raw = {"config": {**cfg, "rate": a.rate, "burst": a.burst, "rounds": a.rounds, "warmup": a.warmup,
                      "unshaped": a.unshaped}, "runs": runs, "profiles": profiles}
    with open(os.path.splitext(a.out)[0] + "_raw.json", "w") as f:  # the samples first: a table bug loses no run
        json.dump(raw, f)
    write_text(a.out, report(a, command_line("pretrain/run.py", argv), raw))
    return 0


if __name__ == "__main__":
    sys.exit(main())
