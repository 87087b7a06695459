"""Tier: pure (no processes). The sub-chunks-per-hop rule of the TP/SP flash operators (ops/tp_sp/hops.py)."""
import pytest

from megatron_flashoverlap.ops.registry import OpPlan
from megatron_flashoverlap.ops.tp_sp.hops import AUTO_P2_CHUNKS, MIN_GEMM_ROWS, _auto_hop_chunks, hop_chunks_for, sized


def test_automatic_is_one_hop_one_transfer_as_measured():
    # the measured choice (hops.py docstring): sub-chunks lost on small blocks and tied elsewhere but at 1 gbit/s
    assert AUTO_P2_CHUNKS == 1
    for p in (2, 3, 4, 8):
        assert hop_chunks_for("flash", None, p, 4 * MIN_GEMM_ROWS, 1) == 1


def test_a_sub_chunked_automatic_rule_applies_at_two_ranks_only_and_keeps_slices_big():
    big = 4 * MIN_GEMM_ROWS
    assert _auto_hop_chunks(2, big, 1, p2_chunks=2) == 2
    assert all(_auto_hop_chunks(p, big, 1, p2_chunks=2) == 1 for p in (3, 4, 8))
    assert _auto_hop_chunks(2, MIN_GEMM_ROWS, 1, p2_chunks=2) == 1  # a sub-chunk would have < MIN_GEMM_ROWS rows
    assert _auto_hop_chunks(2, MIN_GEMM_ROWS // 2, 4, p2_chunks=2) == 2  # rows count sequence rows x batch
    assert _auto_hop_chunks(2, 3 * MIN_GEMM_ROWS, 1, p2_chunks=4) == 3  # the largest c that keeps them big


def test_explicit_counts_are_capped_at_the_rows_and_other_algos_run_one():
    assert hop_chunks_for("flash", 4, 3, 3, 1) == 3  # every sub-chunk keeps at least one row
    assert hop_chunks_for("flash", 4, 2, 100, 1) == 4
    for algo in ("reference", "slicing", "flash_bidir"):
        assert hop_chunks_for(algo, None, 2, 1000, 8) == 1


def test_the_plan_is_sized_once_per_group_and_shard():
    assert sized(OpPlan("flash", hop_chunks=4), 3, 3, 1).hop_chunks == 3  # capped at the shard's rows
    assert sized(OpPlan("flash"), 2, 1000, 8).hop_chunks == 1  # automatic: 1 (measured)
    assert sized(OpPlan("flash"), 2, 1000, 8) is sized(OpPlan("flash"), 2, 1000, 8)  # resolved once, then cached
    for plan in (OpPlan("reference"), OpPlan("slicing", num_chunks=2), OpPlan("flash_bidir")):
        assert sized(plan, 2, 1000, 8) is plan and plan.hops == 1


@pytest.mark.parametrize("bad", [0, -1, 2.0, True, "2"])
def test_bad_requests_name_the_fix(bad):
    with pytest.raises(ValueError, match="integer >= 1"):
        OpPlan("flash", hop_chunks=bad)
    with pytest.raises(ValueError, match="knob of algo 'flash' only"):
        OpPlan("slicing", num_chunks=2, hop_chunks=2)
    OpPlan("slicing", num_chunks=2, hop_chunks=None)
