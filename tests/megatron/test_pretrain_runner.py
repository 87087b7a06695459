"""The shared pretrain() start-up (tests/support/pretrain_runner.py) leaks nothing from one run into the next.

Tier 2 (2 ranks under torchrun, newest lane). The same two jobs (stock and --flash-overlap, the launcher's Llama
run) run first in their batch, in a fresh process, and again after every other job of that batch (about half the
session's two-rank jobs: flash runs with our DDP and config active, other parallel layouts, MoE, checkpoints):
each must log the same losses to the bit (the same process, the same code, the same seed: nothing reorders a sum),
the same GEMM sites line (the log-once sets were reset), and the repeated stock run no plugin line (pretrain()'s
DDP class was restored).
"""
import pytest

from tests.megatron.test_pretrain import FLASH, LAUNCH
from tests.support.pretrain_runs import AFTER, FIRST, Job

ARMS = {"stock": LAUNCH, "flash": (*LAUNCH, *FLASH)}
JOBS = [Job(f"fresh-{arm}", "launch", argv, order=FIRST) for arm, argv in ARMS.items()]
JOBS += [Job(f"again-{arm}", "launch", argv, order=AFTER) for arm, argv in ARMS.items()]


@pytest.mark.newest_only
@pytest.mark.pretrain(*JOBS)
@pytest.mark.parametrize("arm", sorted(ARMS))
def test_a_run_after_others_equals_the_same_run_in_a_fresh_process(pretrain, arm):
    fresh, again = pretrain(f"fresh-{arm}").check(), pretrain(f"again-{arm}").check()
    assert len(fresh.losses) == 8 and fresh.losses == again.losses
    assert fresh.sites == again.sites and fresh.sites.startswith("GEMM sites: ")
    if arm == "stock":
        assert "--flash-overlap" not in again.text and fresh.sites == "GEMM sites: stock"
