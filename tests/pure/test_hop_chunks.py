"""Tier: pure (no processes). The sub-chunks-per-hop rule of the TP/SP flash operators (ops/tp_sp/hops.py)."""
import pytest

from megatron_flashoverlap.ops.tp_sp.hops import AUTO_P2_CHUNKS, MIN_GEMM_ROWS, check_hop_chunks, hop_chunks_for


def test_automatic_is_sub_chunked_at_two_ranks_only():
    big = 4 * MIN_GEMM_ROWS
    assert hop_chunks_for("flash", None, 2, big, 1) == AUTO_P2_CHUNKS > 1
    for p in (3, 4, 8):
        assert hop_chunks_for("flash", None, p, big, 1) == 1


def test_automatic_keeps_gemm_slices_big_enough():
    # a sub-chunk below MIN_GEMM_ROWS GEMM rows (sequence rows x batch) is not made
    assert hop_chunks_for("flash", None, 2, MIN_GEMM_ROWS, 1) == 1
    assert hop_chunks_for("flash", None, 2, MIN_GEMM_ROWS // 2, 4) == AUTO_P2_CHUNKS


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
