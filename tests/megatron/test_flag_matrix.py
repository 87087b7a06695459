"""Every Megatron-LM flag set of the table (tests/megatron/flag_matrix.py) trains with --flash-overlap as stock
does: the same `lm loss` at every iteration, and the flash run's GEMM sites line shows ours ran (a flag that never
took effect fails the test).

Tier 2 (torchrun ranks; newest lane: the 0.16.1 wheel has no megatron.training). Each run is the per-rank
command `-m megatron_flashoverlap.launch --cpu tests/megatron/pretrain_script.py <flags> [--flash-overlap]`,
all of them in the session's shared start-up per world size (the `pretrain` fixture). A row a known defect stops
gets `Row.xfail` naming the issue item: xfail(strict=True), run last in its batch, and the test flips to a failure
(XPASS strict) when the fix lands, so the mark goes (issue 26 items 4 and 5 had their CP=2 and bf16 rows so).
"""
import pytest

from tests.megatron.flag_matrix import BASE, ITERS, ROWS, SCRIPT
from tests.support.pretrain_runs import FLASH, LAST, Job

# fp32: a tensor-parallel sum over 2 ranks is a+b (commutative), our decomposed collectives and Megatron's give
# the same values; 1e-5 relative leaves room for BLAS choosing another kernel for a sliced GEMM (reordered dots).
RTOL = 1e-5
# bf16: iteration 1 within 1e-3 (a bf16 ulp is 2^-8 = 3.9e-3 relative: one rounding of a reordered sum); after
# the first update a weight one ulp apart is a different model, so later iterations get 1e-2.
BF16_RTOL = {1: 1e-3, "later": 1e-2}


def _jobs(row) -> tuple:
    order = {"order": LAST} if row.xfail else {}  # an expected failure that hangs would end the batch
    head = ("--cpu", SCRIPT, *BASE)
    return (Job(f"{row.name}-stock", "launch", (*head, *(row.stock_flags or row.flags)), row.world, **order),
            Job(f"{row.name}-flash", "launch", (*head, *row.flags, *FLASH), row.world, **order))


def _param(row):
    marks = [pytest.mark.pretrain(*_jobs(row))]
    if row.xfail:
        marks.append(pytest.mark.xfail(strict=True, reason=row.xfail))
    return pytest.param(row, id=row.name, marks=marks)


def rtol(row, iteration: int) -> float:
    if "--bf16" not in row.flags:
        return RTOL
    return BF16_RTOL[1] if iteration == 1 else BF16_RTOL["later"]


@pytest.mark.newest_only
@pytest.mark.parametrize("row", [_param(row) for row in ROWS])
def test_flash_overlap_logs_stocks_loss_at_every_iteration(pretrain, row):
    stock, flash = pretrain(f"{row.name}-stock").check(), pretrain(f"{row.name}-flash").check()
    assert sorted(stock.losses) == sorted(flash.losses) == list(range(1, ITERS + 1)), (stock.losses, flash.losses)
    for i, s in stock.losses.items():
        assert abs(flash.losses[i] - s) <= rtol(row, i) * abs(s), (row.name, i, s, flash.losses[i])
    assert stock.sites == "GEMM sites: stock", stock.sites
    assert flash.sites is not None and "=flash" in flash.sites and row.sites in flash.sites, flash.sites
