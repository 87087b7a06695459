"""A checkpoint saved by stock Megatron resumes under --flash-overlap and one saved under --flash-overlap
resumes stock, in both of Megatron's formats (torch_dist, torch): the four resumes log the same losses as each
other and as the same run trained without a break.

Tier 2 (2 ranks, the shared pretrain() start-up; newest lane). A tiny GPT, TP=2 + SP, constant learning rate
(the schedule then does not depend on --train-iters): each arm trains SAVED iterations and saves; the other arm
loads it (model, optimizer, RNG and the data position) and trains to TOTAL; a stock run trains to TOTAL without a
break. Megatron's checkpoint writer needs psutil (requirements/*.txt).
"""
import pytest

from tests.megatron.flag_matrix import BASE, SCRIPT, TP2
from tests.support.pretrain_runs import Job

SAVED, TOTAL = 3, 6
FORMATS = ("torch_dist", "torch")
ARMS = {"stock": (), "flash": ("--flash-overlap",)}
OTHER = {"stock": "flash", "flash": "stock"}
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
                            _argv(TOTAL, *flag, "--ckpt-format", fmt, "--load", f"{{tmp}}/ckpt-{OTHER[arm]}-{fmt}")))
    return jobs


@pytest.mark.newest_only
@pytest.mark.pretrain(*_jobs())
def test_checkpoints_interchange_between_stock_and_flash_in_both_formats(pretrain):
    straight = pretrain("ckpt-straight").check().losses
    assert sorted(straight) == list(range(1, TOTAL + 1)) and straight[TOTAL] < straight[1]
    for fmt in FORMATS:
        for arm in ARMS:
            saved = pretrain(f"ckpt-save-{arm}-{fmt}").check()
            assert sorted(saved.losses) == list(range(1, SAVED + 1)), saved.losses
            for i, loss in saved.losses.items():
                assert abs(loss - straight[i]) <= RTOL * straight[i], (fmt, arm, i, loss, straight[i])
            assert f"successfully saved checkpoint from iteration {SAVED:7d}" in saved.text, saved.text[-2000:]
            resumed = pretrain(f"ckpt-resume-{arm}-{fmt}").check()
            assert sorted(resumed.losses) == list(range(SAVED + 1, TOTAL + 1)), (fmt, arm, resumed.losses)
            for i, loss in resumed.losses.items():
                assert abs(loss - straight[i]) <= RTOL * straight[i], (fmt, arm, i, loss, straight[i])
            want = "GEMM sites: stock" if arm == "stock" else "GEMM sites: dense[1-2]: qkv=flash"
            assert resumed.sites.startswith(want), resumed.sites
