"""benchmarks/gpu_check/run.py's driver: runs parts (a)-(f) within a time budget and writes gpu.md.

    run(budget_s, dry=False) -> {"meta": {...}, part: rows | {"error": text} | {"skipped": why}}
    markdown(res) -> str

Each part runs inside its own try: one failing part is reported as its traceback's last line and the
others still run. `dry=True` (or no CUDA) runs only what a CPU can: part (a)'s operator table on the fake
process group (shapes and dtypes, no sync check), and says so in every other section.
"""
from __future__ import annotations

import datetime
import time
import traceback

import torch

from benchmarks.gpu_check import check as g

PARTS = {
    "a": "Zero host syncs: every public operator and one Flash layer, fwd+bwd, fake process group",
    "b": "Slicing cost: P (and 2P) row slices of each GEMM site against the unsplit GEMM (goal <= 3 %)",
    "c": "Host overhead per ring step (fake process group, tiny CUDA tensors, forward)",
    "d": "Peak memory per operator, fwd+bwd, P = 4, 8k tokens x b = 2, d_model 4096",
    "e": "CUDA graph capture and replay of one Flash MLP layer forward (8k tokens, d_model 4096)",
    "f": "NCCL on two or more GPUs: numerics against stock, host run-ahead, overlap table",
}


def _meta(dry: bool) -> dict:
    cuda = torch.cuda.is_available()
    return {"device": torch.cuda.get_device_name(0) if cuda else "no CUDA device", "gpus": torch.cuda.device_count(),
            "torch": torch.__version__, "cuda": torch.version.cuda, "dry": dry,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def _guarded(fn, *args):
    t = time.monotonic()
    try:
        out = fn(*args)
    except Exception:  # noqa: BLE001 - reported, the other parts still run
        out = {"error": traceback.format_exc().strip().splitlines()[-1]}
    return out, time.monotonic() - t


def _multi(budget_s: float):
    from benchmarks.gpu_check.multi import run as run_multi

    n = torch.cuda.device_count()
    if n < 2:
        return {"skipped": f"{n} GPU visible: NCCL numerics and the overlap table need two or more"}
    return run_multi(min(n, 8), timeout_s=budget_s)


def run(budget_s: float = 420.0, dry: bool = False) -> dict:
    dry = dry or not torch.cuda.is_available()
    res = {"meta": _meta(dry), "seconds": {}}
    if dry:
        res["a"], res["seconds"]["a"] = _guarded(g.sync_rows, "cpu", True)
        for part in "bcdef":
            res[part] = {"skipped": "dry run (no CUDA, or --dry): nothing measured"}
        return res
    t0 = time.monotonic()
    left = lambda: budget_s - (time.monotonic() - t0)  # noqa: E731
    for part, fn, args in (("a", g.sync_rows, ()), ("c", g.host_rows, ()), ("e", g.graph_rows, ()),
                           ("d", g.memory_rows, ())):
        res[part], res["seconds"][part] = _guarded(fn, *args)
    res["b"], res["seconds"]["b"] = _guarded(g.slicing_rows, time.monotonic() + max(left() - 150, 30))
    res["f"], res["seconds"]["f"] = _guarded(_multi, max(left() - 10, 30))
    return res


def _fmt(key: str, v) -> str:
    """Shares (cost ..., hidden) as signed percentages, other floats to 4 significant digits."""
    if isinstance(v, float):
        return f"{100 * v:+.1f} %" if key.startswith(("cost", "hidden")) else f"{v:.4g}"
    return str(v)


def _table(rows: list[dict]) -> list[str]:
    cols = list(dict.fromkeys(k for r in rows for k in r))
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    out += ["| " + " | ".join(_fmt(c, r.get(c, "")) for c in cols) + " |" for r in rows]
    return out


def _section(part: str, body) -> list[str]:
    lines = [f"## ({part}) {PARTS[part]}", ""]
    if isinstance(body, dict) and ("error" in body or "skipped" in body):
        return lines + [f"{'ERROR' if 'error' in body else 'Skipped'}: {body.get('error') or body['skipped']}", ""]
    if part == "f":
        return lines + _multi_lines(body) + [""]
    if part == "a":
        bad = [r for r in body if r["shapes"] != "ok" or r["first_sync"] not in ("none", "not checked (dry run)")]
        lines += [f"{len(body)} calls, {len(bad)} with a wrong shape/dtype or a host sync.", ""]
    return lines + _table(body) + [""]


def _multi_lines(body: dict) -> list[str]:
    lines = [f"world {body['world']}; relative RMS error vs fp64: " + ", ".join(
        f"{k} {v:.3e}" for k, v in body["numerics"]["rel_rms"].items()),
        f"all_gather_matmul flash == reference bit for bit: {body['numerics']['ag_flash_equals_reference']} "
        f"(max relative difference {body['numerics']['ag_max_rel_diff']:.2e})",
        f"host run-ahead: {body['run_ahead']}", ""]
    return lines + _table([{"variant": k, **v} for k, v in body["overlap"].items()])


def markdown(res: dict) -> str:
    m = res["meta"]
    lines = ["# GPU check (benchmarks/gpu_check/run.py)", "",
             f"{m['device']} x {m['gpus']}, torch {m['torch']}, CUDA {m['cuda']}, {m['date']}"
             + (" — DRY RUN: nothing was measured on a GPU" if m["dry"] else ""), "",
             "Seconds per part: " + ", ".join(f"{k} {v:.0f}" for k, v in res["seconds"].items()), ""]
    for part in PARTS:
        lines += _section(part, res[part])
    return "\n".join(lines)
