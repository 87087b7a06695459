"""Launcher side: run the worker with torchrun inside a shaped namespace, once per link rate.

    run_rates(cfg, rates, burst, unshaped, workdir) -> [worker output + {"rate"}]

One namespace serves every rate (`tc qdisc replace` between runs) and is deleted at the end, also on
errors and Ctrl-C. `unshaped=True` runs on the host loopback and labels the runs "unshaped".
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys

from .netns import shaped_namespace, why_not_shaped


def torchrun_argv(cfg_path: str, out_path: str, world: int = 2) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
            "-m", "megatron_flashoverlap.bench.worker", cfg_path, out_path]


def _env() -> dict:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", ""),
            "TORCH_CPP_LOG_LEVEL": "ERROR", "PYTHONWARNINGS": "ignore"}


def _run(argv: list[str], ns, timeout: float) -> None:
    cmd = ns.exec_argv(argv) if ns is not None else argv
    proc = subprocess.Popen(cmd, env=_env())
    try:
        rc = proc.wait(timeout=timeout)
    except BaseException:  # timeout or Ctrl-C: stop the ranks before the namespace goes
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        raise
    if rc != 0:
        raise RuntimeError(f"benchmark ranks failed (exit {rc}): {' '.join(cmd)}")


def run_rates(cfg: dict, rates: list[str], workdir: str, burst: str = "512kb", unshaped: bool = False,
              timeout: float = 3600.0) -> list[dict]:
    """Run the worker once per rate; returns the outputs, each with "rate" set."""
    if not unshaped and why_not_shaped():
        raise PermissionError(why_not_shaped())
    os.makedirs(workdir, exist_ok=True)
    outs = []
    with (contextlib.nullcontext(None) if unshaped else shaped_namespace(None)) as ns:
        for rate in (["unshaped"] if unshaped else rates):
            if ns is not None:
                ns.shape_lo(rate, burst)
            tag = rate.replace("/", "_")
            cfg_path, out_path = os.path.join(workdir, f"cfg_{tag}.json"), os.path.join(workdir, f"out_{tag}.json")
            with open(cfg_path, "w") as f:
                json.dump({**cfg, "label": f"link {rate}"}, f)
            load0 = os.getloadavg()[0]
            _run(torchrun_argv(cfg_path, out_path), ns, timeout)
            with open(out_path) as f:
                outs.append({**json.load(f), "rate": rate if ns is not None else "unshaped (host loopback)",
                             "loadavg": (load0, os.getloadavg()[0]), "cpus": os.cpu_count()})
    return outs
