"""The CPU proxy's scheduling diagnostic (benchmarks/planner/scheduling.py): its round statistics, and that the
committed tables are what today's code makes from their raw samples.

Tier: pure (reads files; the planner prices the committed calibrations in-process, nothing is measured). Expected
values are worked out in the comments from the samples given.
"""
import json
import pathlib

import pytest

from benchmarks.planner import scheduling as SCH

DATA = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "planner" / "data"


def test_round_statistics():
    s = [0.010, 0.020, 0.011, 0.0126, 0.010]  # sorted: 10, 10, 11, 12.6, 20 ms
    # median 11; p10 at index 0.4 of the sorted list: 10; p90 at index 3.6: 12.6 + 0.6 x (20 - 12.6) = 17.04;
    # max 20; spread (20 - 10) / 10 = 100 %; stalled: over 11 + 1.5 = 12.5 ms: 12.6 and 20
    assert SCH._stats(s) == "11.00 | 10.00 - 17.04 | 20.00 | 100% | 2 / 5"


def test_a_launch_that_did_not_finish_is_a_row_saying_so():
    raw = {"command": "c", "rounds": 3, "bytes": 1024, "rate": "4gbit",
           "transfer": [{"link": "unshaped", "policy": "rr", "samples": None, "failed": "did not finish: x"}],
           "block": [{"arm": "comm first", "failed": "did not finish: y"}]}
    md = SCH.render(raw)
    assert "| unshaped | rr | - | did not finish: x |" in md
    assert "| comm first | - | - | - | did not finish: y |" in md


@pytest.mark.parametrize("name", ["scheduling", "scheduling_2", "scheduling_3"])
def test_committed_tables_are_what_their_samples_give(name):
    raw = json.loads((DATA / f"{name}.json").read_text())
    assert (DATA / f"{name}.md").read_text() == SCH.render(raw)
