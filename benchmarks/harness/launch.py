"""The one rank launcher: N ranks under torchrun, on the host loopback or inside a shaped namespace.

    run_ranks(target, world, *, args=(), ns=None, env=None, rank_env=None, backend="gloo", timeout=3600.0,
              heap=True) -> [result of rank 0, result of rank 1, ...]

target, and what every rank runs:
    "pkg.mod:function"                      init_process_group(backend) (env:// from torchrun), then
                                            result = function(rank, world, *args), then destroy
    "pkg.mod"   or ["pkg.mod", *argv]       the module as __main__ (`python -m pkg.mod argv...`)
    "run.py"    or ["run.py", *argv]        the script as __main__ (`python run.py argv...`)
args (function targets) and results travel as JSON (tuples come back as lists, NaN survives). A module or
script rank hands its result back with `save_result(obj)`; a rank that saved nothing gives None.
ns: a `netns.Namespace` to run in (None: the host). env: on top of OMP_NUM_THREADS=1, PYTHONPATH = this
checkout first, quiet torch logs and, unless heap=False, glibc's heap kept (HEAP). rank_env(rank) -> dict:
applied to os.environ inside that rank before the target runs (before any process group exists: e.g.
GLOO_SOCKET_IFNAME per rank). Every rank starts in this module (`python -m benchmarks.harness.launch DIR`, DIR
holding spec.json and the results), with faulthandler on: a rank killed by a fatal signal (SIGABRT, SIGSEGV)
prints every Python thread's stack on stderr first, so a rare abort says where each thread stood.
A failing rank raises RuntimeError (its traceback is on stderr above), the timeout TimeoutError; both, and
Ctrl-C, stop every rank first (torchrun's own teardown, then its process group is killed).

Example (an examples/ script starting 2 gloo ranks of its own function and reading rank 0's dict):
    out = run_ranks("examples.my_demo:rank_main", 2, args=(opts,), env={"PYTHONPATH": ROOT})[0]
"""
from __future__ import annotations

import contextlib
import faulthandler
import importlib
import json
import os
import runpy
import signal
import subprocess
import sys
import tempfile
from typing import Callable, Mapping, Sequence

from benchmarks.harness.netns import shaped_namespace

ENTRY = "benchmarks.harness.launch"
RESULTS_ENV = "RUN_RANKS_DIR"  # set for every rank: where save_result writes rank<r>.json
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# glibc malloc on this CPU proxy: the heap grows 1 GiB at a time and is never trimmed, so a large tensor comes from
# the heap's top chunk and its pages stay mapped. By default glibc maps and unmaps blocks over its dynamic
# threshold and trims the heap's top, so a step's large tensors fault their pages in again, by an amount that
# depends on the allocation history (a start-up probe's included) and on the sizes an algorithm allocates: stock's
# whole-sequence tensors more than a sliced schedule's. CUDA's caching allocator has no such cost, so every
# benchmark rank runs with it, as with OMP_NUM_THREADS=1 (benchmarks/pretrain names it per arm: "+heap").
HEAP = {"MALLOC_TOP_PAD_": str(1 << 30), "MALLOC_TRIM_THRESHOLD_": str(1 << 36)}


def _split(target: str | Sequence[str], args: Sequence) -> tuple[str, list[str]]:
    """(head, argv) of a target; a bad shape raises ValueError naming the fix."""
    parts = [target] if isinstance(target, str) else list(target)
    if not parts or not parts[0]:
        raise ValueError("run_ranks: empty target; pass 'pkg.mod:function', 'pkg.mod' or 'script.py' (+ argv)")
    head, argv = str(parts[0]), [str(a) for a in parts[1:]]
    if head.endswith(".py"):
        if not os.path.isfile(head):
            raise ValueError(f"run_ranks: no script {head!r}; pass an existing .py path")
        head = os.path.abspath(head)
    if ":" in head and argv:
        raise ValueError(f"run_ranks: {head!r} is a function target: pass its inputs as args=(...), not argv")
    if ":" not in head and args:
        raise ValueError(f"run_ranks: {head!r} is a module/script target: pass argv in target, not args=")
    return head, argv


def _env(extra: Mapping[str, str] | None, results: str, heap: bool) -> dict:
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p)
    base = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path, "TORCH_CPP_LOG_LEVEL": "ERROR",
            "PYTHONWARNINGS": "ignore", **(HEAP if heap else {})}
    return {**base, **(extra or {}), RESULTS_ENV: results}


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to torchrun's process group (it stops its ranks), SIGKILL after 20 s."""
    for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 5)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=wait)
            return


def _wait(cmd: list[str], env: dict, timeout: float, what: str) -> None:
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)  # its own group: one kill stops every rank
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _stop(proc)
        raise TimeoutError(f"run_ranks: {what} ran past {timeout:.0f} s and was stopped; pass a larger timeout=")
    except BaseException:  # Ctrl-C, SIGTERM turned into KeyboardInterrupt: stop the ranks before the namespace
        _stop(proc)
        raise
    if rc != 0:
        raise RuntimeError(f"run_ranks: {what} failed (torchrun exit {rc}); the failing rank's traceback is above")


def run_ranks(target: str | Sequence[str], world: int, *, args: Sequence = (), ns=None,
              env: Mapping[str, str] | None = None, rank_env: Callable[[int], Mapping[str, str]] | None = None,
              backend: str = "gloo", timeout: float = 3600.0, heap: bool = True) -> list:
    """Start `world` ranks of `target` under torchrun (see the module docstring); -> per-rank results."""
    if world < 1:
        raise ValueError(f"run_ranks: world={world}; ask for at least one rank")
    head, argv = _split(target, args)
    with tempfile.TemporaryDirectory(prefix="run-ranks-") as tmp:
        spec = {"target": head, "argv": argv, "args": list(args), "backend": backend,
                "rank_env": {str(r): dict(rank_env(r)) for r in range(world)} if rank_env else {}}
        with open(os.path.join(tmp, "spec.json"), "w") as f:
            json.dump(spec, f)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
               "-m", ENTRY, tmp]
        _wait(ns.exec_argv(cmd) if ns is not None else cmd, _env(env, tmp, heap), timeout, f"{head} on {world} ranks")
        return [_load(os.path.join(tmp, f"rank{r}.json")) for r in range(world)]


def _load(path: str):
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def save_result(obj) -> None:
    """Rank side: hand `obj` (JSON values) back to `run_ranks`; a later call replaces the earlier one."""
    where = os.environ.get(RESULTS_ENV)
    if not where:
        raise RuntimeError("save_result: this process was not started by harness.launch.run_ranks")
    path = os.path.join(where, f"rank{os.environ.get('RANK', '0')}.json")
    with open(path + ".part", "w") as f:
        json.dump(obj, f)
    os.replace(path + ".part", path)


def _call(head: str, args: list, backend: str) -> None:
    import torch.distributed as dist

    mod, name = head.split(":", 1)
    fn = getattr(importlib.import_module(mod), name)
    dist.init_process_group(backend)
    try:
        save_result(fn(dist.get_rank(), dist.get_world_size(), *args))
    finally:
        dist.destroy_process_group()


def _rank_main(spec_dir: str) -> None:
    """Every rank: its own environment first, then the target."""
    faulthandler.enable(all_threads=True)
    with open(os.path.join(spec_dir, "spec.json")) as f:
        spec = json.load(f)
    os.environ.update(spec["rank_env"].get(os.environ.get("RANK", "0"), {}))
    head = spec["target"]
    if ":" in head:
        return _call(head, spec["args"], spec["backend"])
    sys.argv = [head, *spec["argv"]]
    if head.endswith(".py"):
        sys.path.insert(0, os.path.dirname(head))
        runpy.run_path(head, run_name="__main__")
    else:
        runpy.run_module(head, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    _rank_main(sys.argv[1])


STOCK_RS_LABEL = {  # what a results file says of --stock-rs (benchmarks/harness/line_rate_rs.py)
    "ring": "reduce-scatters outside our rings (stock's, the references', slicing's) as P2P rings at line rate "
            "(benchmarks/harness/line_rate_rs.py; gloo's own moves an all-reduce's bytes, 2x NCCL's ring)",
    "gloo": "reduce-scatters outside our rings are gloo's own: an all-reduce's bytes, 2x NCCL's ring (the earlier, "
            "unfair stock baseline)"}


def add_stock_rs_arg(p) -> None:
    """--stock-rs: how stock's reduce-scatters move on gloo (benchmarks/harness/line_rate_rs.py)."""
    p.add_argument("--stock-rs", choices=tuple(STOCK_RS_LABEL), default="ring",
                   help="stock's reduce-scatters as a P2P ring at line rate (default; gloo's own moves an "
                   "all-reduce's bytes: benchmarks/harness/line_rate_rs.py) or gloo's own (the earlier baseline)")


def add_link_args(p, out: str) -> None:
    """The options every single-link benchmark script shares: --repeats --rate --unshaped --timeout --out
    --stock-rs."""
    add_stock_rs_arg(p)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--rate", default="1gbit", help="tbf rate of the namespace's loopback")
    p.add_argument("--unshaped", action="store_true", help="host loopback, no namespace (no root needed)")
    p.add_argument("--timeout", type=float, default=3600.0)
    p.add_argument("--out", default=out)


def run_on_link(target: str, world: int, cfg: dict, a) -> tuple[dict, str]:
    """Rank 0's result of `target` over `world` ranks on the link the add_link_args options name, and the
    link's label."""
    with (contextlib.nullcontext(None) if a.unshaped else shaped_namespace(a.rate)) as ns:
        res = run_ranks(target, world, args=(cfg,), ns=ns, timeout=a.timeout)[0]
    return res, ("unshaped loopback" if a.unshaped else f"tbf {a.rate}")


def write_text(path: str, text: str) -> None:
    """Write a benchmark's markdown (folders made) and print it."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    print(text)


def write_results(out_dir: str, name: str, text: str, raw) -> None:
    """out_dir/NAME.md (the table, printed too) and out_dir/NAME_raw.json (every sample)."""
    write_text(os.path.join(out_dir, f"{name}.md"), text)
    with open(os.path.join(out_dir, f"{name}_raw.json"), "w") as f:
        json.dump(raw, f)


def command_line(script: str, argv: Sequence[str] | None) -> str:
    """The command a results file records: `python benchmarks/SCRIPT ARGS`, quoted for a shell (an argument
    with spaces or ';', e.g. dp.py --arms or overlap.py --methods, pastes back as one)."""
    import shlex
    return f"python benchmarks/{script} " + shlex.join(sys.argv[1:] if argv is None else argv)
