"""Tier: pure (no processes). The sub-chunks-per-hop rule of the TP/SP flash operators
(ops/tp_sp/plain.py hop_chunks_for)."""
import pytest

from megatron_flashoverlap.ops.registry import OpPlan
from megatron_flashoverlap.ops.tp_sp.plain import hop_chunks_for, sized


def test_an_open_request_is_one_transfer_per_hop_as_measured():
    # benchmarks/overlap/RESULTS.md "Hop sub-chunks at P = 2": sub-chunks lost on small blocks, tied elsewhere
    for rows in (1, 64, 4096):
        assert hop_chunks_for("flash", None, rows) == 1


def test_explicit_counts_are_capped_at_the_rows_and_other_algos_run_one():
    assert hop_chunks_for("flash", 4, 3) == 3  # every sub-chunk keeps at least one row
    assert hop_chunks_for("flash", 4, 100) == 4
    for algo in ("reference", "slicing", "flash_bidir"):
        assert hop_chunks_for(algo, None, 1000) == 1
        assert hop_chunks_for(algo, 4, 1000) == 1  # e.g. flash forced to reference: its knob does not apply


def test_the_plan_is_sized_once_per_shard():
    assert sized(OpPlan("flash", hop_chunks=4), 3).hop_chunks == 3  # capped at the shard's rows
    assert sized(OpPlan("flash"), 1000).hop_chunks == 1  # open: 1 (measured)
    assert sized(OpPlan("flash"), 1000) is sized(OpPlan("flash"), 1000)  # resolved once, then cached
    for plan in (OpPlan("reference"), OpPlan("slicing", num_chunks=2), OpPlan("flash_bidir")):
        assert sized(plan, 1000) is plan and plan.hops == 1


@pytest.mark.parametrize("bad", [0, -1, 2.0, True, "2"])
def test_bad_requests_name_the_fix(bad):
    with pytest.raises(ValueError, match="integer >= 1"):
        OpPlan("flash", hop_chunks=bad)
    with pytest.raises(ValueError, match="knob of algo 'flash'"):
        OpPlan("slicing", num_chunks=2, hop_chunks=2)
    OpPlan("slicing", num_chunks=2, hop_chunks=None)
