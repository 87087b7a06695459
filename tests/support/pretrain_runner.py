"""One torchrun start-up for many Megatron `pretrain()` runs (the rank side; the caller is pretrain_runs.py).

    python -m torch.distributed.run --standalone --nproc-per-node N -m tests.support.pretrain_runner JOBS OUT JOB_S

Each rank imports torch, Megatron and the plugin once, then for every job of the JSON list JOBS, in order:
    1. `reset()`: Megatron's global state (training/global_vars, the microbatch calculator, parallel_state's
       groups and memory buffer, the rerun machine, the RNG tracker, the MoE loss tracker) and the plugin's
       (the activated config, pretrain()'s DDP class back to Megatron's, every log-once set), inference's
       process-wide InferenceMode, and the
       environment (Megatron's validate_args writes NVTE_* variables for --attention-backend) back to what it
       was when the batch started, after the CPU shims (what every job's --cpu installs first, once per
       process) were installed; so nothing of one job reaches the next (tests/megatron/test_pretrain_runner.py
       checks a job run last equals the same job run first)
    2. fds 1 and 2 -> OUT/<name>.rank<r>.log
    3. the user's per-rank command, in this process: job {"name", "entry", "argv"} with entry
          "pretrain_gpt"  megatron_flashoverlap.megatron.cli.pretrain_gpt.main(argv)
                          (= `python -m megatron_flashoverlap.pretrain_gpt` on one rank)
          "launch"        megatron_flashoverlap.megatron.cli.launch.main(argv)
                          (= `torchrun ... -m megatron_flashoverlap.launch` on one rank)
          "generate"      megatron_flashoverlap.megatron.cli.generate.main(argv)
                          (= `python -m megatron_flashoverlap.generate` on one rank)
    4. OUT/<name>.rank<r>.done: "ok", or the traceback of what it raised (then the next job runs: a failure
       Megatron raises on every rank leaves the process usable; one that strands a peer in a collective ends
       the batch, so jobs expected to fail run last). A job still running after JOB_S seconds (a hang) dumps
       every thread's stack into its log and ends the process (faulthandler), so torchrun ends the batch.
torch.distributed's default group lives for the whole batch (Megatron's initialize reuses an initialized one).
"""
from __future__ import annotations

import faulthandler
import json
import os
import sys
import traceback



def reset(environ: dict) -> None:
    """Megatron's and the plugin's process-global state back to a fresh process's, `os.environ` to `environ`
    (module docstring)."""
    os.environ.clear()
    os.environ.update(environ)
    _reset_megatron()
    _reset_plugin()


def _reset_megatron() -> None:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.moe import moe_utils
    from megatron.training import global_vars
    from megatron.training.training import destroy_global_state

    from tests.support.pool import end_inference_mode

    destroy_global_state()  # global vars, microbatches, memory buffer, symmetric memory, model parallel, rerun
    _destroy_groups()
    global_vars.unset_global_variables()
    assert not parallel_state.model_parallel_is_initialized()
    mrandom.get_cuda_rng_tracker().reset()
    moe_utils.get_moe_layer_wise_logging_tracker().clear()
    end_inference_mode()  # the dynamic engine sets it process-wide (a generate job before this one)


def _destroy_groups() -> None:
    """Every process group the last job made, destroyed on every rank once all ranks are here (a barrier on
    the default group, which lives for the batch): parallel_state forgets its groups but c10d keeps them,
    and each gloo group's threads poll; ~60 groups a job left 2,400 threads per rank after a matrix batch."""
    import torch.distributed as dist

    from tests.support.pool import _destroy_groups as destroy_all_but_default

    if dist.is_initialized():
        dist.barrier()
        destroy_all_but_default()


def _reset_plugin() -> None:
    from megatron.core.distributed import DistributedDataParallel
    from megatron.training import training
    from megatron.training.models import dist_utils

    from megatron_flashoverlap import config
    from megatron_flashoverlap.runtime.once import LogOnce

    config.activate(None)
    training.DDP = dist_utils.DistributedDataParallel = DistributedDataParallel  # ddp.pretrain.install undone
    for name, module in list(sys.modules.items()):
        if name.startswith("megatron_flashoverlap"):
            for said in [v for v in vars(module).values() if isinstance(v, LogOnce)]:  # the package's log-once sets
                said.clear()


def run_job(job: dict) -> None:
    argv = list(job["argv"])
    if job["entry"] == "pretrain_gpt":
        from megatron_flashoverlap.megatron.cli import pretrain_gpt

        pretrain_gpt.main(argv)
    elif job["entry"] == "launch":
        from megatron_flashoverlap.megatron.cli import launch

        launch.main(argv)
    elif job["entry"] == "generate":
        from megatron_flashoverlap.megatron.cli import generate

        generate.main(argv)
    else:
        raise ValueError(f"job {job['name']}: entry {job['entry']!r} is not pretrain_gpt, launch or generate")


class _Redirect:
    """fds 1 and 2 (and so Python's sys.stdout / stderr, Megatron's loggers, C code) -> `path` while open."""

    def __init__(self, path: str):
        self.path = path

    def __enter__(self):
        sys.stdout.flush()
        sys.stderr.flush()
        self.saved = os.dup(1), os.dup(2)
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        return self

    def __exit__(self, *exc):
        sys.stdout.flush()
        sys.stderr.flush()
        for target, saved in zip((1, 2), self.saved):
            os.dup2(saved, target)
            os.close(saved)


def run_logged(job: dict, stem: str, environ: dict, job_s: float) -> str:
    """Steps 1-3 for one job, its output in `stem`.log; -> "ok" or the traceback."""
    with _Redirect(stem + ".log"):
        faulthandler.dump_traceback_later(job_s, exit=True)
        try:
            reset(environ)
            run_job(job)
        except BaseException as err:  # SystemExit included (Megatron exits on some argument errors)
            if isinstance(err, KeyboardInterrupt):
                raise
            if isinstance(err, SystemExit) and err.code in (0, None):  # Megatron's --exit-interval: a clean end
                return "ok"
            print(traceback.format_exc(), flush=True)
            return traceback.format_exc()
        finally:
            faulthandler.cancel_dump_traceback_later()
    return "ok"


def main(jobs_path: str, out: str, job_s: float) -> None:
    from megatron_flashoverlap.megatron import cpu
    from tests.support.mutations import apply_from_env

    rank = int(os.environ["RANK"])
    apply_from_env()  # a deliberate defect, only where FLASHOVERLAP_TEST_MUTATION names one (mutations.py)
    cpu.enable()  # no-op on a GPU machine; sets CUDA_DEVICE_MAX_CONNECTIONS, part of the environment kept
    environ = dict(os.environ)
    with open(jobs_path) as f:
        jobs = json.load(f)
    for job in jobs:
        stem = os.path.join(out, f"{job['name']}.rank{rank}")
        status = run_logged(job, stem, environ, job_s)
        with open(stem + ".done", "w") as f:
            f.write(status)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], float(sys.argv[3]))
