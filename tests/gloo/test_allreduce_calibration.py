"""Tier 2 (gloo processes) + pure: the calibration table, the selector reading it, the topology report.

No timing assertions: the table's numbers are whatever this machine measured; the tests check that the
command measures every algorithm at every size on every rank alike, merges tables by group layout, and
that "auto" picks exactly what the table says.
"""
import json

import pytest

from benchmarks.topology.table import markdown
from megatron_flashoverlap import config
from megatron_flashoverlap.plan import chooser as ch
from megatron_flashoverlap.plan.chooser import best_at
from megatron_flashoverlap.tools.calibrate_allreduce import MEASURED

ALGOS = ("reference", "ring", "recursive_doubling", "hierarchical", "hierarchical_pipelined", "hierarchical_hd")


def test_calibration_writes_a_table_auto_can_read(pools, tmp_path):
    path = str(tmp_path / "cal.json")
    sizes = [64, 4096]
    per_rank = pools(2).run("tests.gloo.mp_allreduce:calibrate", path, sizes, 1, timeout=240)
    assert per_rank[0] == per_rank[1]  # one max-over-ranks table, the same on every rank
    pools(2).run("tests.gloo.mp_allreduce:calibrate", path, sizes, None, timeout=240)  # a second layout
    tables = json.load(open(path))["tables"]
    assert sorted((t["world_size"], t["local_world_size"]) for t in tables) == [(2, 1), (2, 2)]
    t = next(t for t in tables if t["local_world_size"] == 1)
    assert [r["bytes"] for r in t["rows"]] == sizes
    for r in t["rows"]:
        assert all(r[f"{a}_us"] > 0 and r[f"{a}_min_us"] <= r[f"{a}_us"] for a in ALGOS)
        assert r["auto_ran"] in ALGOS, r  # what the chooser picked for auto's message, recorded beside its time
    chooser = ch.chooser_of(config.from_dict({"all_reduce": {"table": path}}, config.Environment()))
    layout = ch.layout_word(2, 1, "gloo", "float32")
    for r in t["rows"]:  # the decode all-reduce = of the algorithms that beat stock (by median, and in at least
        # 80 % of the paired rounds: both of these 2), the one of lowest median; none: stock
        beat = [a for a in ALGOS[1:] if r[f"{a}_us"] < r["reference_us"]
                and sum(o < s for o, s in zip(r[f"{a}_rounds_us"], r["reference_rounds_us"])) == 2]
        want = min(beat, key=lambda a: r[f"{a}_us"]) if beat else "reference"
        key = ch.Key(ch.DECODE_SITE, "decode", 1, layout, f"h {r['bytes'] // 4}", (0, 1), r["bytes"])
        assert chooser.answer(key).pick == want


def test_best_at_uses_the_nearest_measured_size_and_never_extrapolates():
    rows = [{"bytes": 1024, "stock_us": 10.0, "ring_us": 5.0},
            {"bytes": 1 << 20, "stock_us": 10.0, "ring_us": 50.0}]
    t = {"rows": rows}
    assert best_at(t, 1024) == "ring" and best_at(t, 20000) == "ring"  # log-nearest: 1 KB
    assert best_at(t, 200000) is None and best_at(t, 1 << 20) is None  # nearest 1 MB: stock won
    assert best_at(t, 512) is None and best_at(t, 2 << 20) is None     # outside the measured sizes


def test_a_foreign_table_file_is_refused_naming_the_tool(tmp_path):
    path = tmp_path / "other.json"
    path.write_text(json.dumps({"rows": []}))
    with pytest.raises(ValueError, match="calibrate_allreduce"):
        ch.chooser_of(config.from_dict({"all_reduce": {"table": str(path)}}, config.Environment()))


def test_topology_markdown_speedup_column():
    table = {"world_size": 4, "local_world_size": 2, "dtype": "bfloat16", "iters": 3, "note": "n",
             "measured_at": "t", "rows": [{"bytes": 8192, "stock_us": 3000.0, "ring_us": 4000.0,
                                           "recursive_doubling_us": 1500.0, "hierarchical_us": 2000.0}]}
    line = markdown([table]).splitlines()[4]  # an older file: no pipelined, auto or rounds columns
    assert line == "| 8 KB | 3.00 | 4.00 | 1.50 | 2.00 | - | - | recursive_doubling 2.00x | - | - |"


def test_topology_markdown_reads_a_table_the_calibration_writes_today():
    """The calibration names stock's column `reference_us` (MEASURED = the algorithm words); the table writer
    reads it as the stock column, and still reads `stock_us` from files written before. auto: what the
    start-up table chose at that size, and stock / auto with its interval over the rounds."""
    row = {"bytes": 8192, "reference_us": 3000.0, "ring_us": 4000.0, "recursive_doubling_us": 1500.0,
           "hierarchical_us": 2000.0, "hierarchical_pipelined_us": 2500.0, "auto_us": 1500.0,
           "reference_rounds_us": [3000.0, 3100.0, 2900.0], "auto_rounds_us": [1500.0, 1400.0, 1600.0]}
    startup = {"rows": [{"bytes": 8192, "reference_us": 10.0, "recursive_doubling_us": 5.0}]}
    table = {"world_size": 4, "local_world_size": 2, "dtype": "bfloat16", "iters": 3, "note": "n",
             "measured_at": "2026-11-30", "rows": [row], "startup": startup}
    line = markdown([table]).splitlines()[4]
    assert line.startswith("| 8 KB | 3.00 | 4.00 | 1.50 | 2.00 | 2.50 | - | recursive_doubling 2.00x | "
                           "recursive_doubling | 2.00x [")
    lo, hi = map(float, line.split("[")[1].split("]")[0].split(", "))
    assert 1.0 < lo <= 2.0 <= hi and line.endswith("] win |")  # every resample of these rounds is a win
    assert "reference" in MEASURED and "auto" in MEASURED and "stock" not in MEASURED
