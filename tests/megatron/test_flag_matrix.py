"""Every Megatron-LM flag set of the table (tests/megatron/flag_matrix.py) trains with --flash-overlap as stock
does: the same `lm loss` at every iteration (an FP8 row: within its `fall_tol` of the bf16 run's, and not the same
curve), and the flash run's GEMM sites line shows ours ran (a flag that never took effect fails the test).

Tier 2 (torchrun ranks; newest lane: the 0.16.1 wheel has no megatron.training). Each run is the per-rank
command `-m megatron_flashoverlap.launch --cpu tests/megatron/pretrain_script.py <flags> [--flash-overlap]`,
all of them in the session's shared start-up per world size (the `pretrain` fixture). A row a known defect stops
gets `Row.xfail` naming the issue item: xfail(strict=True), run last in its batch, and the test flips to a failure
(XPASS strict) when the fix lands, so the mark goes (issue 26 items 4 and 5 had their CP=2 and bf16 rows so).
"""
import pytest

from tests.megatron.flag_matrix import ROWS, jobs

# fp32: a tensor-parallel sum over 2 ranks is a+b (commutative), our decomposed collectives and Megatron's give
# the same values; 1e-5 relative leaves room for BLAS choosing another kernel for a sliced GEMM (reordered dots).
RTOL = 1e-5
# bf16: iteration 1 within 1e-3 (a bf16 ulp is 2^-8 = 3.9e-3 relative: one rounding of a reordered sum); after
# the first update a weight one ulp apart is a different model, so later iterations get 1e-2.
BF16_RTOL = {1: 1e-3, "later": 1e-2}


def _param(row):
    marks = [pytest.mark.pretrain(*jobs(row))]
    if row.xfail:
        marks.append(pytest.mark.xfail(strict=True, reason=row.xfail))
    return pytest.param(row, id=row.name, marks=marks)


def rtol(row, iteration: int) -> float:
    if "--bf16" not in row.flags:
        return RTOL
    return BF16_RTOL[1] if iteration == 1 else BF16_RTOL["later"]


def bound(row, stock: dict, iteration: int) -> float:
    """The largest |flash - stock| loss at `iteration`: the row's share of stock's fall, else rtol relative."""
    if row.fall_tol is not None:
        return row.fall_tol * (stock[1] - stock[row.iters])
    return rtol(row, iteration) * abs(stock[iteration])


@pytest.mark.newest_only
@pytest.mark.parametrize("row", [_param(row) for row in ROWS])
def test_flash_overlap_logs_stocks_loss_at_every_iteration(pretrain, row):
    stock, flash = (pretrain(job.name).check() for job in jobs(row))
    assert sorted(stock.losses) == sorted(flash.losses) == list(range(1, row.iters + 1)), (stock.losses, flash.losses)
    for i, s in stock.losses.items():
        assert abs(flash.losses[i] - s) <= bound(row, stock.losses, i), (row.name, i, s, flash.losses[i])
    if row.fall_tol is not None:  # the arms differ by design: the flash run's GEMMs really ran otherwise
        assert flash.losses != stock.losses, flash.losses
    assert stock.sites == "GEMM sites: stock", stock.sites
    assert flash.sites is not None and "=flash" in flash.sites and row.sites in flash.sites, flash.sites
