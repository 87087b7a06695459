"""benchmarks/pretrain/run.py's arms, log parsing and table: Megatron's own training loop on the shaped link.

    ARMS                              arm -> (entry flags after the model's, link: "rate" | "unshaped")
    <arm>+heap                        the arm with glibc's heap kept (harness/launch.py HEAP), the base arm's flags
    model_argv(cfg) -> [megatron args]    TP=2 + SP GPT on mock data, --log-interval 1, timers level 2
    parse_log(text) -> {"iters": {i: ms}, "loss": {i: lm loss}, "timers": {i: {name: max ms}}, "sites",
                        "picks": {choice key: pick}}    picks: the chooser's "flash-overlap chose" lines
    run_stat(parsed, warmup) -> seconds     the run's statistic: the median iteration after `warmup`
    summarize(runs, cfg) -> {"arms": {arm: {...}}, "loss": ..., "comm": ...}    the estimator over rounds
    table(summary) / loss_table(summary) / breakdown_table(summary) -> markdown

One run = one launch of the project entry (`python -m megatron_flashoverlap.pretrain_gpt`) on 2 CPU ranks;
Megatron prints `elapsed time per iteration (ms)` (its interval timer, stopped after a barrier) and
`lm loss` every iteration on the last rank, the per-phase timers ((min, max) across ranks, we keep the max)
after each iteration line, and our entry prints `GEMM sites: ...` on rank 0.

    round r | stock  flash  slicing  flash+keep  stock@unshaped |   one run each, order rotated by r (runtime/timing.py)
    sample  = median(elapsed ms of iterations > warmup) of that run
    speedup = harness/estimator.speedup(stock samples, arm samples): median ratio, 90 % bootstrap interval
"""
from __future__ import annotations

import os
import re
import statistics
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = os.path.join(ROOT, "configs")
ARMS = {
    "stock": ([], "rate"),
    "flash": (["--flash-overlap", "--flash-overlap-config", os.path.join(CONFIGS, "flash.yaml")], "rate"),
    "slicing": (["--flash-overlap", "--flash-overlap-config", os.path.join(CONFIGS, "slicing.yaml")], "rate"),
    # every layer stock or flash, measured at its first training step (the chooser)
    "auto": (["--flash-overlap", "--flash-overlap-config", os.path.join(CONFIGS, "auto.yaml")], "rate"),
    # flash, and the column layers (qkv, fc1) keep AG(x) from forward for the weight gradient: one gather
    # fewer per column layer in backward (stock re-gathers too), memory for time; YAML written by arm_yaml()
    "flash+keep": (["--flash-overlap", "--flash-overlap-config", "{yaml}"], "rate"),
    # flash, every ring hop cut in 2 (4) row sub-chunks: the remote block's GEMM starts on the first to arrive
    "flash+c2": (["--flash-overlap", "--flash-overlap-config", "{yaml}"], "rate"),
    "flash+c4": (["--flash-overlap", "--flash-overlap-config", "{yaml}"], "rate"),
    # both: 2 sub-chunks per hop, and qkv / fc1 keep the gathered input
    "flash+c2+keep": (["--flash-overlap", "--flash-overlap-config", "{yaml}"], "rate"),
    # query-split attention at proj (core attention + proj + reduce-scatter by query block, docs/attention.md):
    # with 2 sub-chunks per hop at the other sites, or with the default chooser at them
    "flash+c2+qsplit": (["--flash-overlap", "--flash-overlap-config", "{yaml}"], "rate"),
    "auto+qsplit": (["--flash-overlap", "--flash-overlap-config", "{yaml}"], "rate"),
    # the default chooser with choices.budget_s 60: on the CPU proxy a probe is slow enough that the default 10 s
    # leaves the last sites unmeasured (stock); with 60 s every site is measured, as on a GPU within 10 s
    "auto+b60": (["--flash-overlap", "--flash-overlap-config", "{yaml}"], "rate"),
    # our spec (SDPA core attention, our norms) with every linear on Megatron's own forward: what the spec
    # alone changes against stock, so flash vs this arm is the overlap alone
    "ours-reference": (["--flash-overlap", "--flash-overlap-config", os.path.join(CONFIGS, "stock.yaml")], "rate"),
    "stock@unshaped": ([], "unshaped"),  # the same stock run with no qdisc: what the link costs stock
    # flash with no qdisc: its compute alone, the most any overlap of these sites can reach at this rate
    "flash@unshaped": (["--flash-overlap", "--flash-overlap-config", os.path.join(CONFIGS, "flash.yaml")],
                       "unshaped"),
}
YAMLS = {  # the arms whose config the benchmark writes (arm_yaml)
    "flash+keep": ("description: flash, qkv and fc1 keep the gathered input for wgrad (benchmarks/pretrain/run.py)\n"
                   "default: {algo: flash}\nqkv: {algo: flash, keep_gathered: true}\n"
                   "fc1: {algo: flash, keep_gathered: true}\n"),
    "flash+c2": "description: flash, 2 row sub-chunks per hop (benchmarks/pretrain/run.py)\n"
                "default: {algo: flash, hop_chunks: 2}\n",
    "flash+c4": "description: flash, 4 row sub-chunks per hop (benchmarks/pretrain/run.py)\n"
                "default: {algo: flash, hop_chunks: 4}\n",
    "flash+c2+keep": ("description: flash, 2 row sub-chunks per hop, qkv and fc1 keep the gathered input for wgrad "
                      "(benchmarks/pretrain/run.py)\ndefault: {algo: flash, hop_chunks: 2}\n"
                      "qkv: {algo: flash, hop_chunks: 2, keep_gathered: true}\n"
                      "fc1: {algo: flash, hop_chunks: 2, keep_gathered: true}\n"),
    "flash+c2+qsplit": ("description: flash, 2 row sub-chunks per hop, proj as query-split attention "
                        "(benchmarks/pretrain/run.py)\ndefault: {algo: flash, hop_chunks: 2}\n"
                        "attention: {query_split: true}\n"),
    "auto+qsplit": ("description: the default chooser, proj as query-split attention (benchmarks/pretrain/run.py)\n"
                    "default: {algo: auto}\nattention: {query_split: true}\n"),
    "auto+b60": ("description: the default chooser, a 60 s measuring budget (benchmarks/pretrain/run.py)\n"
                 "default: {algo: auto}\nchoices: {budget_s: 60}\n"),
}
BASE = "stock"
FAST = "stock@unshaped"
HEAP_SUFFIX = "+heap"  # the arm with glibc's heap kept (harness/launch.py HEAP); without it, glibc's defaults


def base_arm(arm: str) -> str:
    """The arm whose flags and link `arm` runs ("auto+b60+heap" -> "auto+b60")."""
    return arm.removesuffix(HEAP_SUFFIX)


def heap_kept(arm: str) -> bool:
    """Whether `arm`'s ranks run with glibc's heap kept (an "<arm>+heap" arm)."""
    return arm.endswith(HEAP_SUFFIX)

ITER = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([0-9.]+) \|"
                  r".*?lm loss: ([0-9.eE+-]+)")
TIMER = re.compile(r"^\s+([\w./-]+) \.+: \(([0-9.]+), ([0-9.]+)\)\s*$")
CHOSE = re.compile(r"flash-overlap chose (\S+) for (\S+) ")  # plan/chooser.py line(): pick, key word
PHASES = ("forward-backward", "forward-compute", "backward-compute", "all-grads-sync", "optimizer")


def model_argv(cfg: dict) -> list[str]:
    """Megatron arguments of every arm: cfg {"layers", "hidden", "heads", "seq", "mbs", "iters", "vocab"}, and
    "attention_dropout" where given (not None): Megatron's --attention-dropout."""
    c = {k: str(v) for k, v in cfg.items()}
    dropout = [] if cfg.get("attention_dropout") is None else ["--attention-dropout", c["attention_dropout"]]
    return dropout + ["--num-layers", c["layers"], "--hidden-size", c["hidden"], "--num-attention-heads", c["heads"],
            "--seq-length", c["seq"], "--max-position-embeddings", c["seq"], "--micro-batch-size", c["mbs"],
            "--global-batch-size", c["mbs"], "--tensor-model-parallel-size", "2", "--sequence-parallel",
            "--train-iters", c["iters"], "--lr", "1e-4", "--log-interval", "1", "--timing-log-level", "2",
            "--eval-iters", "0", "--eval-interval", "1000000", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", c["vocab"], "--mock-data", "--seed", "1234"]


def entry_argv(arm: str, cfg: dict) -> list[str]:
    """The project entry's argv for one rank of `arm` (`--cpu`, the model, the arm's flags)."""
    base = base_arm(arm)
    if base not in ARMS:
        raise ValueError(f"unknown arm {arm!r}; choose among {sorted(ARMS)}, each also as <arm>{HEAP_SUFFIX}")
    return ["--cpu", *model_argv(cfg), *(arm_yaml(base) if f == "{yaml}" else f for f in ARMS[base][0])]


def arm_yaml(arm: str) -> str:
    """The YAML of an arm the benchmark writes (YAMLS), written once into the temp folder; -> its path."""
    path = os.path.join(tempfile.gettempdir(), f"flashoverlap-pretrain-{arm.replace('+', '-')}.yaml")
    if not os.path.exists(path) or open(path).read() != YAMLS[arm]:
        with open(path, "w") as f:
            f.write(YAMLS[arm])
    return path


def parse_log(text: str) -> dict:
    """One rank's output -> iterations, losses, the timers printed after each iteration, the sites line, the
    chooser's decisions."""
    out: dict = {"iters": {}, "loss": {}, "timers": {}, "sites": None, "picks": {}}
    current = 0  # timers before the first iteration line (set-up) belong to iteration 0
    for line in text.splitlines():
        m = ITER.search(line)
        if m:
            current = int(m.group(1))
            out["iters"][current], out["loss"][current] = float(m.group(2)), float(m.group(3))
            continue
        t = TIMER.match(line)
        if t:
            out["timers"].setdefault(current, {})[t.group(1)] = float(t.group(3))
        elif line.startswith("GEMM sites: "):
            out["sites"] = line[len("GEMM sites: "):].strip()
        elif (c := CHOSE.search(line)) is not None:
            out["picks"][c.group(2)] = c.group(1)
    return out


def merge(ranks: list[dict]) -> dict:
    """Per-rank parses -> one: the iteration / timer lines come from the last rank, the sites from rank 0, the
    picks from the first rank that logged them (every rank takes the same)."""
    out: dict = {"iters": {}, "loss": {}, "timers": {}, "sites": None, "picks": {}}
    for r in ranks:
        if r is None:
            continue
        for key in ("iters", "loss", "timers"):
            out[key].update({int(i): v for i, v in r[key].items()})
        out["sites"] = out["sites"] or r["sites"]
        out["picks"] = out["picks"] or r.get("picks", {})
    return out


def _kept(parsed: dict, warmup: int) -> list[int]:
    kept = sorted(i for i in parsed["iters"] if i > warmup)
    if not kept:
        raise ValueError(f"no iteration after the {warmup} warm-up ones was logged (logged: "
                         f"{sorted(parsed['iters'])}); raise --iters above --warmup, or check the run's log")
    return kept


def run_stat(parsed: dict, warmup: int) -> float:
    """Seconds: the median `elapsed time per iteration` over the iterations after `warmup`."""
    return statistics.median(parsed["iters"][i] for i in _kept(parsed, warmup)) / 1e3


def phases(parsed: dict, warmup: int) -> dict:
    """{phase: median ms over the kept iterations} for Megatron's timers in PHASES (those logged)."""
    kept = _kept(parsed, warmup)
    out = {}
    for name in PHASES:
        vals = [parsed["timers"][i][name] for i in kept if name in parsed["timers"].get(i, {})]
        if vals:
            out[name] = statistics.median(vals)
    return out
