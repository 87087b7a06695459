"""Tier 2 (gloo processes): all_reduce(algo="auto") measures the decode all-reduce's choice on the real group.

No table file: the first decode-shaped call of a token bucket times stock and every candidate in paired rounds
(ops/all_reduce/choose.py decode_pick) on the group, every rank decides on the same numbers (the max over
ranks), group rank 0 logs one line, and that call and every later one run the pick (plan/chooser.py's rule).
No timing assertions on which algorithm wins here: the tests check that the choice follows the measurement,
identically on every rank, once; a candidate made slow on one rank only is never taken by any rank. A table
file answers instead: nothing is measured.
Sums: exact here (small integers in float32: every order of the additions gives the same bits).
"""
import pytest

from megatron_flashoverlap.ops.all_reduce.choose import candidates
from megatron_flashoverlap.ops.choose import ROUNDS


def _decision(per_rank, word):
    got = [r["decided"][word] for r in per_rank]
    assert all(g[0] == got[0][0] and g[3] == got[0][3] for g in got), got  # one pick, one set of medians
    return got[0]


@pytest.mark.parametrize("world,local", [(4, 2), (2, 2), (2, 1)])
def test_first_decode_call_measures_its_bucket_then_follows_the_measurement(pools, world, local):
    per_rank = pools(world).run("tests.gloo.mp_allreduce_startup:startup", local, (1, 3, 1024), timeout=300)
    pick, source, reason, medians = _decision(per_rank, "all_reduce/decode/4")  # 3 tokens: the bucket of 4
    assert source == "measured" and sorted(medians) == sorted(candidates(world, local))
    assert ("hierarchical_pipelined" in candidates(world, local)) is (1 < local < world)
    assert str(ROUNDS) in reason  # "won k/5 paired rounds"
    for rank, r in enumerate(per_rank):
        assert r["before"] == (False, {}), "a prefill-shaped call must neither measure nor run ours"
        assert list(r["decided"]) == ["all_reduce/decode/4"]  # measured once: the second call reused it
        assert r["exact"] and r["same_again"]
        assert r["ours"] is (pick != "reference") and r["again"] is r["ours"], "auto must run what was measured"
        said = [ln for ln in r["lines"] if "flash-overlap chose" in ln]
        assert len(said) == (1 if rank == 0 else 0), r["lines"]  # one line, on group rank 0, not again
    assert f"{pick} for all_reduce/decode/4 ({world} ranks, {local} per node, gloo, float32" in \
        next(ln for ln in per_rank[0]["lines"] if "flash-overlap chose" in ln)


def test_a_candidate_slow_on_one_rank_is_taken_by_no_rank(pools):
    """Ranks whose own timings disagree (ring 30 ms late on rank 1 only) decide alike, and not ring: the
    decision is on the max over ranks. The mutation a chooser preferring a slower candidate would make."""
    per_rank = pools(2).run("tests.gloo.mp_allreduce_startup:startup", 2, (1, 2, 64), None, ("ring", 1, 0.03),
                            timeout=300)
    pick, _, _, medians = _decision(per_rank, "all_reduce/decode/2")
    assert pick != "ring" and medians["ring"] > 30000 > medians["reference"], medians


def test_a_table_file_answers_instead_of_a_measurement(pools):
    rows = [{"bytes": b, "reference_us": 100.0, "ring_us": 90.0, "recursive_doubling_us": 10.0} for b in (64, 1 << 20)]
    table = {"tables": [{"world_size": 2, "local_world_size": 2, "backend": "gloo", "dtype": "float32",
                         "rows": rows}]}
    per_rank = pools(2).run("tests.gloo.mp_allreduce_startup:startup", 2, (1, 2, 1024), table)
    for r in per_rank:
        pick, source, reason, medians = r["decided"]["all_reduce/decode/2"]
        assert (pick, source, medians) == ("recursive_doubling", "measured", {}) and "all_reduce.table" in reason
        assert r["ours"] and r["exact"]
    other = pools(2).run("tests.gloo.mp_allreduce_startup:startup", 1, (1, 2, 1024), table)
    for r in other:  # the file lacks this layout: stock, said, nothing measured
        pick, source, reason, medians = r["decided"]["all_reduce/decode/2"]
        assert (pick, source, medians) == ("reference", "model", {}) and "no entry" in reason
        assert not r["ours"] and r["exact"]
