"""Where one rank's training iteration goes: Megatron's own torch-profiler trace, cut into categories.

    profile_argv(folder, start, end) -> Megatron flags: torch profiler on rank 0, iterations start+1..end,
                                        trace written to folder/torch_profile/rank-0.json.gz
    categorize(trace_path) -> {"steps": n, "step_ms": mean ms per profiled iteration, "ms": {category: ms},
                               "wait_ms": {category: ms of it inside no aten:: op (waits, Python)}}
    profile_table({arm: categorize(...)}) -> markdown

Every instant of the main thread's profiled iterations goes to the first category (CATEGORIES order) whose
events cover it (an event's whole span, children included: a stock collective inside Megatron's linear
counts as that linear), the rest is "other": Python, norms, element-wise ops, the data loader, idle waits.
A category's "wait" part is its time inside no aten:: op: on gloo a blocking collective's wait and our
ring's waits run in no operator (the c10d:: events are only the posts), so it is mostly exposed transfer.

    step      |-------------------------------------------------------------------------|
    ours      |=AllGatherMatmul=|     |=MatmulReduceScatter=|    ...
    c10d      |                 |=ar=|                       ...            (claimed only where free)
"""
from __future__ import annotations

import gzip
import json
import os

# (category, event-name prefixes), claimed in this order. The autograd Function names are Megatron's
# (tensor_parallel/layers.py, mappings.py, cross_entropy.py) and ours (ops/tp_sp autograd Functions).
CATEGORIES = (
    ("flash TP linears (ours)", ("AllGatherMatmul", "MatmulReduceScatter",
                                 "autograd::engine::evaluate_function: AllGatherMatmul",
                                 "autograd::engine::evaluate_function: MatmulReduceScatter")),
    ("Megatron linears (stock: all TP linears + output layer; flash: output layer)",
     ("LinearWithGradAccumulationAndAsyncCommunication",
      "autograd::engine::evaluate_function: LinearWithGradAccumulationAndAsyncCommunication")),
    ("attention core (ours: SDPA; stock: Megatron's baddbmm / softmax / bmm)",
     ("aten::scaled_dot_product_attention", "aten::baddbmm", "aten::bmm", "aten::_softmax")),
    ("Megatron SP mappings (embedding all-reduce + scatter; stock also the row layers' reduce-scatter)",
     ("_ScatterToSequenceParallelRegion", "_ReduceScatterToSequence", "_GatherFromSequenceParallelRegion",
      "_ReduceFromModelParallel", "autograd::engine::evaluate_function: _Scatter",
      "autograd::engine::evaluate_function: _Gather", "autograd::engine::evaluate_function: _Reduce")),
    ("vocab-parallel cross entropy", ("_VocabParallelCrossEntropy",
                                      "autograd::engine::evaluate_function: _VocabParallelCrossEntropy")),
    ("optimizer step", ("Optimizer.step",)),
    ("other collectives (grad sync, grad norm, loss, barriers)", ("c10d::",)),
)
OTHER = "other (python, norms, element-wise, data, idle)"


def profile_argv(folder: str, start: int, end: int) -> list[str]:
    """Megatron's own profiler flags (training.py: schedule wait=start-1, warmup=1, active=end-start)."""
    if not 1 <= start < end:
        raise ValueError(f"profile iterations start={start}, end={end}: pass 1 <= start < end <= --iters")
    return ["--profile", "--use-pytorch-profiler", "--profile-step-start", str(start), "--profile-step-end",
            str(end), "--profile-ranks", "0", "--tensorboard-dir", os.path.join(folder, "tb")]


def trace_path(folder: str) -> str:
    return os.path.join(folder, "torch_profile", "rank-0.json.gz")


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _minus(spans: list[tuple[float, float]], taken: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """spans \\ taken, both unions (sorted, disjoint)."""
    out, j = [], 0
    for a, b in spans:
        while j < len(taken) and taken[j][1] <= a:
            j += 1
        k, cur = j, a
        while k < len(taken) and taken[k][0] < b:
            if taken[k][0] > cur:
                out.append((cur, taken[k][0]))
            cur = max(cur, taken[k][1])
            k += 1
        if cur < b:
            out.append((cur, b))
    return out


def _length(spans) -> float:
    return sum(b - a for a, b in spans)


def categorize_events(events: list[dict]) -> dict:
    """Chrome-trace complete events ("ph": "X", us) -> the categories of the ProfilerStep thread."""
    steps = [e for e in events if e.get("ph") == "X" and e["name"].startswith("ProfilerStep#")]
    if not steps:
        raise ValueError("no ProfilerStep# event in the trace: the profiled iterations did not run (check "
                         "--profile-step-start / --profile-step-end against --iters)")
    tid = steps[0]["tid"]
    window = _union([(e["ts"], e["ts"] + e["dur"]) for e in steps])
    main = [e for e in events if e.get("ph") == "X" and e["tid"] == tid]
    aten = _union([(e["ts"], e["ts"] + e["dur"]) for e in main if e["name"].startswith("aten::")])
    taken: list[tuple[float, float]] = []
    ms, wait = {}, {}
    for name, prefixes in CATEGORIES:
        spans = _union([(e["ts"], e["ts"] + e["dur"]) for e in main if e["name"].startswith(prefixes)])
        mine = _minus(_minus(spans, taken), _minus(spans, window))  # free time inside the profiled steps
        ms[name] = _length(mine) / 1e3 / len(steps)
        wait[name] = _length(_minus(mine, aten)) / 1e3 / len(steps)
        taken = _union(taken + mine)
    ms[OTHER] = (_length(window) - _length(taken)) / 1e3 / len(steps)
    return {"steps": len(steps), "step_ms": _length(window) / 1e3 / len(steps), "ms": ms, "wait_ms": wait}


def categorize(path: str) -> dict:
    with gzip.open(path, "rt") as f:
        return categorize_events(json.load(f)["traceEvents"])


def profile_table(profiles: dict) -> str:
    """| category | ms per iteration (of it in no aten op), one column per arm |, the step time last."""
    arms = list(profiles)
    rows = ["| category (rank 0, ms per iteration (of which in no aten op: waits, Python)) | " + " | ".join(arms)
            + " |", "|---" * (len(arms) + 1) + "|"]
    for name in [c for c, _ in CATEGORIES]:
        rows.append(f"| {name} | " + " | ".join(f"{profiles[a]['ms'][name]:.0f} ({profiles[a]['wait_ms'][name]:.0f})"
                                                for a in arms) + " |")
    rows.append(f"| {OTHER} | " + " | ".join(f"{profiles[a]['ms'][OTHER]:.0f}" for a in arms) + " |")
    rows.append("| **profiled iteration** | " + " | ".join(f"{profiles[a]['step_ms']:.0f}" for a in arms) + " |")
    return "\n".join(rows)
