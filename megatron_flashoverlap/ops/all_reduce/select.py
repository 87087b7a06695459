"""Run-time choice between stock all-reduce and ours, from a measured table (never a guessed threshold).

The table comes from `python -m megatron_flashoverlap.bench.calibrate_allreduce` (JSON, one entry per group
layout): per message size in bytes, the median latency of stock and of each of our algorithms.

    {"tables": [{"world_size": 4, "local_world_size": 2, "backend": "gloo", "dtype": "bfloat16",
                 "rows": [{"bytes": 8192, "stock_us": 812.0, "ring_us": ..., "recursive_doubling_us": ...,
                           "hierarchical_us": ...}, ...]}]}

"auto" uses ours only when (1) the input is decode-shaped: [1, b, h] in Megatron's [s, b, h] layout (one
new token per sequence; prefill and training go to stock, as NVRAR does), (2) a table for this group's
(world_size, local_world_size) is loaded, (3) the size lies inside the measured sizes, and (4) at the
measured size nearest to it (log scale) our fastest algorithm beat stock. Anything else: stock.
The table is read from `FLASHOVERLAP_ALLREDUCE_TABLE` on first use, or set with `set_calibration`.
"""
from __future__ import annotations

import json
import logging
import math
import os

import torch

from ...schedules import ALL_REDUCE_ALGOS

log = logging.getLogger(__name__)
_TABLES: list | None = None
_WARNED: set = set()


def set_calibration(source) -> None:
    """Load the tables from a JSON path or an already-parsed dict; None forgets them (auto -> stock)."""
    global _TABLES
    if source is None:
        _TABLES = []
        return
    data = json.load(open(source)) if isinstance(source, (str, os.PathLike)) else source
    if "tables" not in data:
        raise ValueError("all-reduce calibration: expected {'tables': [...]}, as written by "
                         "python -m megatron_flashoverlap.bench.calibrate_allreduce")
    _TABLES = list(data["tables"])


def _tables() -> list:
    if _TABLES is None:
        path = os.environ.get("FLASHOVERLAP_ALLREDUCE_TABLE")
        set_calibration(path if path else None)
    return _TABLES


def table_for(world: int, local_world_size: int) -> dict | None:
    for t in _tables():
        if t["world_size"] == world and t["local_world_size"] == local_world_size:
            return t
    return None


def is_decode_shaped(x: torch.Tensor) -> bool:
    """[1, b, h]: one new token per sequence (Megatron's [s, b, h] layout with a KV cache)."""
    return x.dim() == 3 and x.shape[0] == 1


def best_at(table: dict, nbytes: int) -> str | None:
    """Our fastest algorithm at the measured size nearest `nbytes` if it beat stock there; None otherwise
    (also outside the measured sizes: no extrapolation)."""
    rows = table["rows"]
    sizes = [r["bytes"] for r in rows]
    if not rows or not min(sizes) <= nbytes <= max(sizes):
        return None
    row = min(rows, key=lambda r: abs(math.log(r["bytes"]) - math.log(max(nbytes, 1))))
    ours = {a: row[f"{a}_us"] for a in ALL_REDUCE_ALGOS if f"{a}_us" in row}
    if not ours:
        return None
    algo = min(ours, key=ours.get)
    return algo if ours[algo] < row["stock_us"] else None


def _should_use_x(x: torch.Tensor, world: int, local_world_size: int) -> bool:
    """Ours for decode-shaped inputs inside the calibrated window. Basis: the loaded calibration table."""
    return is_decode_shaped(x) and _pick(x, world, local_world_size) is not None


def _pick(x: torch.Tensor, world: int, local_world_size: int) -> str | None:
    table = table_for(world, local_world_size)
    if table is None:
        key = (world, local_world_size)
        if key not in _WARNED:
            _WARNED.add(key)
            log.warning("all_reduce(algo='auto'): no calibration table for world_size=%d local_world_size=%d; "
                        "using stock all-reduce (run python -m megatron_flashoverlap.bench.calibrate_allreduce)", *key)
        return None
    return best_at(table, x.numel() * x.element_size())


def choose(x: torch.Tensor, world: int, local_world_size: int) -> str:
    """The algorithm "auto" runs: ours where `_should_use_x`, else "stock"."""
    return _pick(x, world, local_world_size) if _should_use_x(x, world, local_world_size) else "stock"
