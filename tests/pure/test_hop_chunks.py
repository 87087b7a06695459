"""Tier: pure (no processes). The sub-chunks-per-hop rule of the TP/SP flash operators (ops/tp_sp/hops.py)."""
import pytest

from megatron_flashoverlap.ops.tp_sp.hops import (
    AUTO_P2_CHUNKS, MIN_GEMM_ROWS, _auto_hop_chunks, check_hop_chunks, hop_chunks_for,
)


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


@pytest.mark.parametrize("bad", [0, -1, 2.0, True, "2"])
def test_bad_requests_name_the_fix(bad):
    with pytest.raises(ValueError, match="integer >= 1"):
        check_hop_chunks("all_gather_matmul", "flash", bad)
    with pytest.raises(ValueError, match="knob of algo 'flash' only"):
        check_hop_chunks("all_gather_matmul", "slicing", 2)
    check_hop_chunks("all_gather_matmul", "slicing", None)
