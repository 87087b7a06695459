"""A persistent pool of gloo worker processes that runs test functions by name.

Start-up (a fork from a forkserver that imported torch and megatron-core once, then init_process_group) costs
about a second; a job costs milliseconds.
`Pool(world_size).run("tests.mp_ops:check_ag", arg, ...)` runs `check_ag(rank, world_size, arg, ...)` on
every worker and returns the per-rank results. Every wait has a timeout: a job that raises on any rank
raises `WorkerError` with that rank's traceback; a job that times out (a hang, a dead peer) raises
`WorkerTimeout`. Either way the pool is torn down (workers killed) and rebuilt on the next run, so one
failing test cannot poison or hang the next. The process groups jobs leave behind are destroyed in place
(`_reset`) once their threads pass RESET_ABOVE: the threads poll, and a respawn costs the start-up again
(12 Megatron GPT jobs on 4 workers: 61-79 s recycling, 26-30 s resetting).
"""
from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import queue
import socket
import sys
import time
import traceback


class WorkerError(AssertionError):
    """A job raised on some rank; the message holds that rank's traceback."""


class WorkerTimeout(TimeoutError):
    """A job did not finish on every rank in time; the pool was killed."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _threads() -> int:
    """Native threads of this process (Linux); 0 where /proc is absent."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 0


# Every process group a job creates (megatron's initialize_model_parallel makes dozens, gloo twins
# included) keeps its gloo threads after destroy_model_parallel: about 1,900 threads per worker after a
# suite, whose polling took 80 % of the CPU as system time (an idle worker with ~190 threads burns ~9 % of
# a core, measured). So a job that leaves a worker above RESET_ABOVE threads (a fresh one has ~7, one
# initialize_model_parallel adds ~60) has the groups destroyed after it (_reset: ~10 ms a group; 12 GPT jobs
# took the same time resetting above 50 or above 150 threads, and an idle worker near 50 burns ~2 % of a
# core); a worker still above MAX_THREADS after that is recycled.
RESET_ABOVE = 50
MAX_THREADS = 300


def _reset() -> int:
    """Back to a fresh worker's process-group state once a job leaves it above RESET_ABOVE threads:
    Megatron's model-parallel globals cleared (where a job imported it) and every process group but the
    default one destroyed (local calls, no collective); -> native threads after it."""
    if _threads() > RESET_ABOVE and _destroy_groups():
        ps = sys.modules.get("megatron.core.parallel_state")
        if ps is not None:
            ps.destroy_model_parallel()
    return _threads()


def end_inference_mode() -> None:
    """Megatron's process-wide InferenceMode off (the dynamic engine sets it and leaves it set; a later training
    job in the same process then takes inference paths). Only where a job imported it (megatron-core 0.19)."""
    utils = sys.modules.get("megatron.core.inference.utils")
    if utils is not None and hasattr(utils, "InferenceMode"):
        utils.InferenceMode.unset_active()


def _destroy_groups() -> int:
    """Destroys every process group but the default one; -> how many. A group's threads are joined when its
    last reference goes, so this holds none past its return."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    default = c10d._get_default_group()
    left = [pg for pg in c10d._world.pg_map if pg is not default]
    for pg in left:
        dist.destroy_process_group(pg)
    return len(left)


# A spawned worker imported torch (about 1.5 s of CPU) and, at its first Megatron job, megatron-core (about 4.5 s):
# a 4-rank pool's start with one Megatron job took 10.2-10.7 s of wall on 2 cores. Workers forked from one
# forkserver that imported both once (pool_preload.py: nothing of the package or the tests, one thread when it
# forks) took 1.0 s. A worker takes the environment the pool's process has when it starts, as a spawned one did.
PRELOAD = ["tests.support.pool_preload"]


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # read once, when the first worker starts the server
    return ctx


def _worker(rank: int, world: int, port: int, jobs, results, env: dict) -> None:
    os.environ.clear()
    os.environ.update(env)
    sys.path.insert(0, env["PYTHONPATH"])  # the test modules live beside the package, under the root
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    from tests.support.mutations import apply_from_env

    apply_from_env()  # a deliberate defect, only where FLASHOVERLAP_TEST_MUTATION names one (mutations.py)
    environ = dict(os.environ)
    while True:
        job = jobs.get()
        if job is None:
            break
        target, args, kwargs = job
        try:
            mod, fn = target.split(":")
            out = getattr(importlib.import_module(mod), fn)(rank, world, *args, **kwargs)
            results.put((rank, True, (out, _reset())))
        except BaseException:  # noqa: BLE001 - the traceback goes back to the test
            results.put((rank, False, traceback.format_exc()))
        finally:  # what a job set (Megatron's NVTE_* for an attention backend, LOCAL_WORLD_SIZE, the inference
            os.environ.clear()  # engine's process-wide InferenceMode) ends with it
            os.environ.update(environ)
            end_inference_mode()
    dist.destroy_process_group()


class Pool:
    """`world_size` spawned gloo ranks on loopback; `run` sends one job to all of them."""

    def __init__(self, world_size: int, env: dict | None = None, start_timeout: float = 120.0):
        self.world_size = world_size
        self.env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": os.getcwd(), **(env or {})}
        self.start_timeout = start_timeout
        self._procs: list = []

    def _start(self) -> None:
        ctx = _context()
        self._results = ctx.Queue()
        self._jobs = [ctx.Queue() for _ in range(self.world_size)]
        port = _free_port()
        env = {**os.environ, **self.env}  # what a spawned worker would have inherited now, then the pool's own
        self._procs = [ctx.Process(target=_worker, daemon=True,
                                   args=(r, self.world_size, port, self._jobs[r], self._results, env))
                       for r in range(self.world_size)]
        for p in self._procs:
            p.start()

    def run(self, target: str, *args, timeout: float = 120.0, **kwargs) -> list:
        """Run `target(rank, world_size, *args, **kwargs)` on every rank; results indexed by rank."""
        if not self._procs or not all(p.is_alive() for p in self._procs):
            self.close()
            self._start()
            timeout += self.start_timeout
        for q in self._jobs:
            q.put((target, args, kwargs))
        out: dict = {}
        errors: dict = {}
        deadline = time.monotonic() + timeout
        while len(out) + len(errors) < self.world_size:
            try:
                rank, ok, val = self._results.get(timeout=0.5)
                (out if ok else errors)[rank] = val
                continue
            except queue.Empty:
                pass
            dead = [r for r, p in enumerate(self._procs) if not p.is_alive() and r not in out and r not in errors]
            late = time.monotonic() > deadline
            if dead or late:
                waiting = sorted(set(range(self.world_size)) - set(out) - set(errors))
                self.close()
                why = f"ranks {dead} died" if dead else f"ranks {waiting} did not finish within {timeout:.0f} s"
                raise WorkerTimeout(f"{target}: {why}; the pool was killed") from None
        if errors:
            self.close()
            rank = min(errors)
            raise WorkerError(f"{target} failed on rank {rank} of {self.world_size}:\n{errors[rank]}")
        if max(out[r][1] for r in out) > MAX_THREADS:
            self.close()  # threads that are not a group's: the next run starts fresh workers
        return [out[r][0] for r in range(self.world_size)]

    def close(self) -> None:
        for p in self._procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=5)
        self._procs = []
