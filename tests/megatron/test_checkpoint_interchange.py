"""A checkpoint saved by stock Megatron resumes under --flash-overlap and one saved under --flash-overlap
resumes stock, in both of Megatron's formats (torch_dist, torch): the four resumes log the same losses, and their
first iteration (the loaded weights, before an update) the loss of the same run trained without a break.

Tier 2 (2 ranks, the shared pretrain() start-up; newest lane). A tiny GPT, TP=2 + SP, constant learning rate
(the schedule then does not depend on --train-iters): each arm trains SAVED iterations and saves; the other arm
loads it (model, optimizer, RNG and the data position) and trains to TOTAL; a stock run trains to TOTAL without a
break. Only the first resumed iteration is compared with that run: Megatron's own resume (stock from stock alike)
logs iteration SAVED + 2 off the unbroken run's (5.2807 vs 5.2093, measured) while SAVED + 1 and SAVED + 3 agree
to the digit; the resumes compare with each other at every iteration. Megatron's checkpoint writer needs
psutil (requirements/*.txt).
"""
import pytest

from tests.megatron.flag_matrix import BASE, SCRIPT, TP2
from tests.support.pretrain_runs import FLASH, Job

SAVED, TOTAL = 3, 6
FORMATS = ("torch_dist", "torch")
ARMS = {"stock": (), "flash": FLASH}
OTHER = {"stock": "flash", "flash": "stock"}
# the scheduler's step counts follow --train-iters (SAVED when saved, TOTAL now), which Megatron refuses to mix; at a
# constant learning rate and weight decay the values are the same either way: keep this run's
RESUME = ("--override-opt_param-scheduler",)
# the same model, weights and data: fp32 sums over 2 TP ranks (a+b == b+a); 1e-5 relative as the flag matrix
RTOL = 1e-5


def _argv(iters: int, *extra: str) -> tuple:
    base = list(BASE)
    base[base.index("--train-iters") + 1] = str(iters)
    return ("--cpu", SCRIPT, *base, *TP2, "--lr-decay-style", "constant", *extra)


def _jobs() -> list:
    jobs = [Job("ckpt-straight", "launch", _argv(TOTAL))]
    for fmt in FORMATS:
        for arm, flag in ARMS.items():
            jobs.append(Job(f"ckpt-save-{arm}-{fmt}", "launch", _argv(SAVED, *flag, "--ckpt-format", fmt, "--save",
                                                                     f"{{tmp}}/ckpt-{arm}-{fmt}", "--save-interval",
                                                                     str(SAVED))))
        for arm, flag in ARMS.items():  # resume what the other arm saved
            jobs.append(Job(f"ckpt-resume-{arm}-{fmt}", "launch",
                            _argv(TOTAL, *flag, "--ckpt-format", fmt, "--load", f"{{tmp}}/ckpt-{OTHER[arm]}-{fmt}",
                                  *RESUME)))
    return jobs


@pytest.mark.newest_only
@pytest.mark.pretrain(*_jobs())
def test_checkpoints_interchange_between_stock_and_flash_in_both_formats(pretrain):
    straight, resumes = pretrain("ckpt-straight").check().losses, []
    assert sorted(straight) == list(range(1, TOTAL + 1)) and straight[TOTAL] < straight[1]
    for fmt in FORMATS:
        for arm in ARMS:
            saved = pretrain(f"ckpt-save-{arm}-{fmt}").check()
            assert sorted(saved.losses) == list(range(1, SAVED + 1)), saved.losses
            for i, loss in saved.losses.items():
                assert abs(loss - straight[i]) <= RTOL * straight[i], (fmt, arm, i, loss, straight[i])
            assert f"successfully saved checkpoint from iteration {SAVED:7d}" in saved.text, saved.text[-2000:]
            resumed = pretrain(f"ckpt-resume-{arm}-{fmt}").check()
            loaded = [ln.rstrip() for ln in resumed.logs[0].splitlines() if "successfully loaded checkpoint" in ln]
            assert len(loaded) == 1 and f"/ckpt-{OTHER[arm]}-{fmt} [" in loaded[0], resumed.logs[0][-2000:]
            assert loaded[0].endswith(f"at iteration {SAVED}"), loaded
            assert sorted(resumed.losses) == list(range(SAVED + 1, TOTAL + 1)), (fmt, arm, resumed.losses)
            first = resumed.losses[SAVED + 1]  # the loaded weights' loss, before any update of this run
            assert abs(first - straight[SAVED + 1]) <= RTOL * straight[SAVED + 1], (fmt, arm, first, straight)
            resumes.append(resumed.losses)
            want = "GEMM sites: stock" if arm == "stock" else "GEMM sites: dense[1-2]: qkv=flash"
            assert resumed.sites.startswith(want), resumed.sites
    for other in resumes[1:]:  # the four resumes: the same curve
        assert all(abs(other[i] - loss) <= RTOL * loss for i, loss in resumes[0].items()), resumes
