"""Tier 1 (pure): calibration tables are keyed by (backend, dtype, world_size, local_world_size).

A table measured on another backend or dtype (or one lacking those keys) never steers "auto"; the writer
replaces only the entry with the same key; the table path comes from config.environment().
"""
import json
from pathlib import Path

import pytest
import torch

from megatron_flashoverlap.tools.calibrate_allreduce import write
from megatron_flashoverlap.ops.all_reduce import select

ROWS = [{"bytes": b, "stock_us": 100.0, "ring_us": 90.0, "recursive_doubling_us": 10.0, "hierarchical_us": 50.0}
        for b in (8, 1 << 20)]
DECODE_F32 = torch.zeros(1, 2, 8)  # [1, b, h] fp32, 64 bytes


def _entry(backend="gloo", dtype="float32", world=4, local=2, rows=ROWS):
    return {"world_size": world, "local_world_size": local, "backend": backend, "dtype": dtype, "rows": rows}


@pytest.fixture
def tables():
    def load(*entries):
        select.set_calibration({"tables": list(entries)})
    yield load
    select.set_calibration(None)


def test_auto_uses_only_the_table_of_its_backend_and_dtype(tables):
    tables(_entry())  # gloo, float32: recursive doubling beats stock
    assert select.choose(DECODE_F32, 4, 2, "gloo") == "recursive_doubling"
    assert select.choose(DECODE_F32, 4, 2, "nccl") == "reference"                  # a gloo table never steers NCCL
    assert select.choose(DECODE_F32.bfloat16(), 4, 2, "gloo") == "reference"       # nor another dtype
    assert select.choose(DECODE_F32, 4, 4, "gloo") == "reference"                  # nor another layout
    assert select.choose(DECODE_F32, 8, 2, "gloo") == "reference"
    assert select.choose(DECODE_F32, 4, None, "gloo") == "reference"               # no usable node layout


def test_each_key_picks_its_own_table(tables):
    slow = [dict(r, recursive_doubling_us=1000.0, ring_us=1000.0, hierarchical_us=1000.0) for r in ROWS]
    tables(_entry("nccl", "float32", rows=slow), _entry("gloo", "bfloat16", rows=slow), _entry())
    assert select.choose(DECODE_F32, 4, 2, "gloo") == "recursive_doubling"
    assert select.choose(DECODE_F32, 4, 2, "nccl") == "reference"
    assert select.choose(DECODE_F32.bfloat16(), 4, 2, "gloo") == "reference"
    assert select.table_for(4, 2, "nccl", "float32")["rows"] is slow


def test_an_entry_without_backend_or_dtype_is_never_used(tables):
    old = _entry()
    del old["backend"], old["dtype"]
    tables(old)
    assert select.table_for(4, 2, "gloo", "float32") is None
    assert select.choose(DECODE_F32, 4, 2, "gloo") == "reference"


def test_writer_replaces_only_the_same_key(tmp_path):
    path = str(tmp_path / "cal.json")
    write(path, _entry(dtype="float32"))
    write(path, _entry(dtype="bfloat16"))
    write(path, _entry(backend="nccl"))
    write(path, _entry(dtype="float32", rows=ROWS[:1]))  # a re-run replaces its own entry only
    got = json.load(open(path))["tables"]
    keys = sorted((t["backend"], t["dtype"], len(t["rows"])) for t in got)
    assert keys == [("gloo", "bfloat16", 2), ("gloo", "float32", 1), ("nccl", "float32", 2)]


def test_table_path_comes_from_the_environment_reader(tmp_path, monkeypatch):
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({"tables": [_entry()]}))
    monkeypatch.setenv("FLASHOVERLAP_ALLREDUCE_TABLE", str(path))
    select._TABLES = None  # forget what was loaded: the next lookup reads the environment
    try:
        assert select.choose(DECODE_F32, 4, 2, "gloo") == "recursive_doubling"
    finally:
        select.set_calibration(None)
    src = Path(select.__file__).read_text()
    assert "FLASHOVERLAP_" not in src and "os.environ" not in src  # config.environment() is the one reader


def test_a_noisy_win_stays_stock():
    """Ours by median but faster in fewer than PAIRED_WINS of the paired rounds: stock (never slower than stock)."""
    row = {"bytes": 1024, "reference_us": 10.0, "ring_us": 9.0,
           "reference_rounds_us": [10.0, 10.0, 10.0, 10.0, 10.0], "ring_rounds_us": [9.0, 9.0, 9.0, 11.0, 11.0]}
    assert select.best_at({"rows": [row]}, 1024) is None  # 3 of 5 paired wins
    row["ring_rounds_us"] = [9.0, 9.0, 9.0, 9.0, 11.0]
    assert select.best_at({"rows": [row]}, 1024) == "ring"  # 4 of 5
    del row["ring_rounds_us"]
    assert select.best_at({"rows": [row]}, 1024) == "ring"  # an older file keeps medians only: the median decides
