"""Tier 2 (gloo processes): all_reduce(algo="auto") measures its choice at start-up on the real group.

No table file: the first decode-shaped call on a layout measures every candidate (calibrate.py) on the group,
every rank holds the same table (times all-reduced, MAX), group rank 0 logs one line with the choice per size,
and that call and every later one run what the table says (ours where best_at names ours, stock otherwise).
No timing assertions: which algorithm wins is whatever the ranks measured; the tests check that the choice
follows the measurement, identically on every rank, once. A table file overrides: nothing is measured.
Sums: exact here (small integers in float32: every order of the additions gives the same bits).
"""
import pytest

from megatron_flashoverlap.ops.all_reduce.calibrate import ROUNDS, SIZES, candidates
from megatron_flashoverlap.ops.all_reduce.select import choices

SMALL_SIZES = (2048, 16384, 131072)  # the measurement's sizes in the fast cases (the default: calibrate.SIZES)


def _one_table(per_rank):
    tables = [r["table"] for r in per_rank]  # the measured rows are the same; "seconds" is each rank's own clock
    assert tables[0] is not None and all(t["rows"] == tables[0]["rows"] for t in tables), "ranks hold other tables"
    return tables[0]


@pytest.mark.parametrize("world,local", [(4, 2), (2, 2), (2, 1)])
def test_first_decode_call_measures_then_follows_the_measurement(pools, world, local):
    per_rank = pools(world).run("tests.gloo.mp_allreduce_startup:startup", local, (1, 2, 1024), SMALL_SIZES,
                                timeout=300)
    t = _one_table(per_rank)
    assert [r["bytes"] for r in t["rows"]] == list(SMALL_SIZES)
    for row in t["rows"]:  # every candidate of this layout measured; hierarchical only where 1 < G < P
        medians = [k[:-3] for k in row if k.endswith("_us") and not k.endswith(("_min_us", "_rounds_us"))]
        assert sorted(medians) == sorted(candidates(world, local))
        assert all(len(row[f"{a}_rounds_us"]) == ROUNDS for a in medians)  # the kept rounds, for best_at's rule
    assert ("hierarchical_pipelined" in candidates(world, local)) is (1 < local < world)
    for rank, r in enumerate(per_rank):
        assert r["before"] == (False, {}), "a prefill-shaped call must neither measure nor run ours"
        assert r["exact"] and r["same_again"]
        assert r["ours"] is (r["best"] is not None) and r["again"] is r["ours"], "auto must run what was measured"
        calib = [ln for ln in r["lines"] if "start-up calibration" in ln]
        assert len(calib) == (1 if rank == 0 else 0), r["lines"]  # one line, on group rank 0, not again
    line = next(ln for ln in per_rank[0]["lines"] if "start-up calibration" in ln)
    assert f"{world // local} nodes x {local}" in line and choices(t) in line


def test_the_default_sizes_cover_decode(pools):
    per_rank = pools(4).run("tests.gloo.mp_allreduce_startup:startup", 2, (1, 4, 4096), None, timeout=600)
    t = _one_table(per_rank)
    assert [r["bytes"] for r in t["rows"]] == list(SIZES) and SIZES[0] <= 2048 and SIZES[-1] >= 4 << 20
    assert all(r["exact"] for r in per_rank)


def test_a_table_file_overrides_the_startup_calibration(pools):
    rows = [{"bytes": b, "reference_us": 100.0, "ring_us": 90.0, "recursive_doubling_us": 10.0} for b in (64, 1 << 20)]
    table = {"tables": [{"world_size": 2, "local_world_size": 2, "backend": "gloo", "dtype": "float32",
                         "rows": rows}]}
    per_rank = pools(2).run("tests.gloo.mp_allreduce_startup:startup", 2, (1, 2, 1024), SMALL_SIZES, table)
    for r in per_rank:
        assert r["table"] is None and r["ours"] and r["best"] == "recursive_doubling" and r["exact"]
        assert not any("start-up calibration" in ln for ln in r["lines"])
    other = pools(2).run("tests.gloo.mp_allreduce_startup:startup", 1, (1, 2, 1024), SMALL_SIZES, table)
    for r in other:  # the file lacks this layout: stock, logged, nothing measured
        assert r["table"] is None and not r["ours"] and r["exact"]
        assert any("in the table file" in ln for ln in r["lines"])
