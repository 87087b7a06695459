"""The benchmark cost models and the one timing loop, checked against hand-computed values.

Tier: pure (no processes). Every expected number below is worked out by hand in the comment beside it;
all are small integers or halves in float64, so the comparisons are exact (no sum is rounded).
"""
import shlex

import pytest

from benchmarks.overlap.costmodel import ag_pipeline, causal_block_costs, exposed_hops, rs_pipeline
from benchmarks.harness.launch import _split, command_line
from megatron_flashoverlap.runtime.timing import interleaved, rank_max, timed


def test_pipelines_by_hand():
    # flash AG at P=2: local slice (2) overlaps the hop (3), then the arrived slice (2): 3 + 2
    assert ag_pipeline([(None, 2.0), (0, 2.0)], [3.0]) == 5.0
    # stock AG: hop then whole GEMM
    assert ag_pipeline([(0, 4.0)], [3.0]) == 7.0
    # slicing k=2: chunks of 1.5; chunk 0 at 1.5 -> 3.5, chunk 1 arrived at 3.0 -> 5.5
    assert ag_pipeline([(0, 2.0), (1, 2.0)], [1.5, 1.5]) == 5.5
    # flash RS at P=2: peer block (2) then send (3) while own block (2) computes: max(4, 5)
    assert rs_pipeline([(2.0, 3.0), (2.0, 0.0)]) == 5.0
    # slicing RS: the last chunk's transfer is the tail
    assert rs_pipeline([(2.0, 1.5), (2.0, 1.5)]) == 5.5


def test_cost_model_causal_exposes_the_cheap_steps():
    # P = 4, causal block costs 1, 3, 5, 7 (block d sees (d + 1/2) s/P keys); uniform costs 4 each
    causal, uniform = [1.0, 3.0, 5.0, 7.0], [4.0] * 4
    assert exposed_hops(uniform, 4.0, 4) == 0.0  # every hop fits under a block of the same length
    # by hand, hop 2: rank 1 ends at 17 (its step-2 partial waits for rank 0's 12 + 2) vs 16 of compute
    assert exposed_hops(causal, 2.0, 4) == 1.0
    # by hand, hop 4: rank 2 ends at 20 (15 + 5 own block, or rank 1's 16 + 4) vs 16 of compute
    assert exposed_hops(causal, 4.0, 4) == 4.0
    assert exposed_hops(causal, 1.0, 4) == 0.0  # a hop shorter than the cheapest block always hides


def test_zigzag_blocks_cost_the_same_and_hide_the_hop():
    plain, zig = causal_block_costs(64, 4), causal_block_costs(64, 4, zigzag=True)
    # rows 16d .. 16d+15 see t+1 keys: 16 * 16d + 136 = 136, 392, 648, 904
    assert plain == [136.0, 392.0, 648.0, 904.0]
    assert zig == [520.0] * 4 and sum(zig) == 64 * 65 / 2  # the same total work, evenly: 2080 / 4
    hop = 0.5 * sum(plain) / 4  # a hop half as long as the average block
    assert exposed_hops(plain, hop, 4) > 0.2 * sum(plain) / 4 and exposed_hops(zig, hop, 4) == 0.0


def test_interleaved_runs_every_variant_per_round_and_drops_warmup():
    calls = []
    clock = iter(range(100))

    def variant(name):
        return lambda: (calls.append(name), float(next(clock)))[1]
    out = interleaved({"a": variant("a"), "b": variant("b")}, 2, warmup=1)
    assert calls == ["a", "b"] * 3  # 1 warm-up + 2 rounds, a then b in every round
    assert out == {"a": [2.0, 4.0], "b": [3.0, 5.0]}  # clock values 0, 1 were the warm-up round


def test_interleaved_rotates_the_order_per_round():
    calls = []
    out = interleaved({k: (lambda k=k: calls.append(k) or 0.0) for k in "abc"}, 3, warmup=0, rotate=True)
    assert calls == list("abc" "bca" "cab") and all(len(v) == 3 for v in out.values())


def test_interleaved_refuses_no_rounds():
    with pytest.raises(ValueError, match="rounds >= 1"):
        interleaved({"a": lambda: 0.0}, 0)


def test_rank_max_without_a_group_and_timed_counts_the_sync():
    assert rank_max({"a": [1.0, 2.0]}) == {"a": [1.0, 2.0]}  # one process: the samples themselves
    seen = []
    assert timed(lambda: seen.append("fn"), barrier=False, sync=lambda: seen.append("sync")) >= 0.0
    assert seen == ["fn", "sync"]


def test_launcher_targets_are_checked_before_any_process():
    assert _split("pkg.mod:fn", (1,)) == ("pkg.mod:fn", [])
    assert _split(["pkg.mod", "--x", 3], ()) == ("pkg.mod", ["--x", "3"])
    with pytest.raises(ValueError, match="args="):
        _split(["pkg.mod:fn", "--x"], ())
    with pytest.raises(ValueError, match="argv in target"):
        _split("pkg.mod", (1,))
    with pytest.raises(ValueError, match="existing .py"):
        _split("no/such/script.py", ())
    with pytest.raises(ValueError, match="empty target"):
        _split([], ())


def test_results_record_a_command_that_pastes_back_into_a_shell():
    argv = ["--arms", "stock;ours, auto", "--methods", "stock,slicing k=2", "--repeats", "3"]
    line = command_line("dp/run.py", argv)
    assert line.startswith("python benchmarks/dp/run.py ") and shlex.split(line)[2:] == argv
