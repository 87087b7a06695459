"""Pool jobs for tests/gloo/test_pool.py: process groups that outlive their job, and what a worker holds."""
import os

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from tests.support.pool import _threads


def groups_left_behind(rank, world, n):
    """Creates `n` groups over every rank (as Megatron's initialize_model_parallel does, without destroying
    them), all-reduces over the last; -> (pid, native threads, the sum)."""
    groups = [dist.new_group(list(range(world))) for _ in range(n)]
    t = torch.ones(1)
    dist.all_reduce(t, group=groups[-1])
    return os.getpid(), _threads(), t.item()


def state(rank, world):
    """-> (pid, native threads, process groups registered); a WORLD all-reduce checks the default group."""
    t = torch.ones(1)
    dist.all_reduce(t)
    return os.getpid(), _threads(), len(c10d._world.pg_map), t.item()


def set_environment(rank, world, name, value):
    """-> the variable's value before this job set it (a job that changes the environment, as Megatron's
    attention-backend check sets NVTE_*)."""
    import os

    before = os.environ.get(name)
    os.environ[name] = value
    return before


def set_inference_mode(rank, world):
    """-> whether Megatron's process-wide InferenceMode was on when this job started; then sets it, as the
    dynamic engine does and leaves it."""
    from megatron.core.inference.utils import InferenceMode

    before = InferenceMode.is_active()
    InferenceMode.set_active()
    return before
