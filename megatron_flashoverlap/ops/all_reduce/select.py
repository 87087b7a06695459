"""Run-time choice between stock all-reduce and ours, from a measured table (never a guessed threshold).

The table is measured at start-up on the real group (calibrate.py: once per layout, backend and dtype, the
first time a decode-shaped tensor asks for "auto"; `install` keeps it), unless a table file overrides it:
`python -m megatron_flashoverlap.tools.calibrate_allreduce` writes one (JSON, one entry per group layout),
read from `config.environment().allreduce_table` (all_reduce.table) or `set_calibration`. A loaded file is
the whole truth: a layout it lacks runs stock (logged), nothing is measured. Per message size in bytes, a
table holds the median latency of stock and of each of our algorithms.

    {"tables": [{"world_size": 4, "local_world_size": 2, "backend": "gloo", "dtype": "bfloat16",
                 "rows": [{"bytes": 8192, "reference_us": 812.0, "ring_us": ..., "recursive_doubling_us": ...,
                           "hierarchical_us": ...}, ...]}]}

"auto" uses ours only when (1) the input is decode-shaped: [1, b, h] in Megatron's [s, b, h] layout (one
new token per sequence; prefill and training go to stock, as NVRAR does), (2) the group's node layout is
node-contiguous and balanced (`node_layout`), (3) a table for exactly this (backend, dtype, world_size,
local_world_size) is loaded or measured: a gloo or float32 table never steers NCCL or bfloat16, (4) the size
lies inside the measured sizes, and (5) at the measured size nearest to it (log scale) our fastest algorithm
beat stock. Anything else: stock, with one log line per reason and layout.

Node layout: LOCAL_WORLD_SIZE = L ranks per node of the whole job, so global rank g sits on node g // L.
A group's ranks, in group-rank order, are node-contiguous when each node's ranks are consecutive group
ranks, and balanced when every node holds as many (G); the hierarchical schedule needs both
(group rank = node * G + local).
"""
from __future__ import annotations

import json
import logging
import math
import os

from dataclasses import dataclass
from typing import Sequence

import torch

from ...config import environment
from ...runtime.once import LogOnce
from ...schedules import ALL_REDUCE_ALGOS

log = logging.getLogger(__name__)
_TABLES: list | None = None  # the override file's tables (None: not read yet; []: none given)
_MEASURED: dict = {}          # start-up calibrations: (world, G, backend, dtype) -> table


def set_calibration(source) -> None:
    """Load the override tables from a JSON path or an already-parsed dict; None forgets them and every
    start-up calibration (auto then measures again on first use)."""
    global _TABLES
    _MEASURED.clear()
    if source is None:
        _TABLES = []
        return
    data = json.load(open(source)) if isinstance(source, (str, os.PathLike)) else source
    if "tables" not in data:
        raise ValueError("all-reduce calibration: expected {'tables': [...]}, as written by "
                         "python -m megatron_flashoverlap.tools.calibrate_allreduce")
    _TABLES = list(data["tables"])


def _tables() -> list:
    if _TABLES is None:
        set_calibration(environment().allreduce_table)
    return _TABLES


def dtype_name(dtype: torch.dtype) -> str:
    """The table's dtype key: torch.bfloat16 -> "bfloat16"."""
    return str(dtype).replace("torch.", "")


def _key(t: dict) -> tuple:
    return t.get("world_size"), t.get("local_world_size"), t.get("backend"), t.get("dtype")


def table_for(world: int, local_world_size: int, backend: str, dtype: str) -> dict | None:
    """The table measured on exactly this layout, backend and dtype (the override file's where one is loaded,
    else the start-up calibration's); entries lacking a key never match."""
    key = (world, local_world_size, str(backend), dtype)
    if _tables():
        return next((t for t in _tables() if _key(t) == key), None)
    return _MEASURED.get(key)


def needs_startup(world: int, local_world_size: int, backend: str, dtype: str) -> bool:
    """Whether "auto" must measure this layout first: no override file and no start-up table for the key."""
    return not _tables() and (world, local_world_size, str(backend), dtype) not in _MEASURED


def install(table: dict) -> str:
    """Keep a start-up table (calibrate.startup_table) for its key -> the one line saying what auto chose."""
    _MEASURED[_key(table)] = table
    return (f"all_reduce(algo='auto'): start-up calibration on {table['world_size']} ranks "
            f"({table['world_size'] // table['local_world_size']} nodes x {table['local_world_size']}), "
            f"{table['backend']}, {table['dtype']}, {table.get('seconds', 0):.1f} s: {choices(table)} (a table file "
            f"overrides this: all_reduce.table)")


def _fmt(n: int) -> str:
    return f"{n >> 20} MB" if n >= 1 << 20 else f"{n >> 10} KB" if n >= 1 << 10 else f"{n} B"


def choices(table: dict) -> str:
    """'2 KB-64 KB recursive_doubling, 128 KB-4 MB reference': the choice per run of measured sizes."""
    runs: list[list] = []
    for r in table["rows"]:
        pick = best_at(table, r["bytes"]) or "reference"
        if runs and runs[-1][2] == pick:
            runs[-1][1] = r["bytes"]
        else:
            runs.append([r["bytes"], r["bytes"], pick])
    return ", ".join(f"{_fmt(a)}{'' if a == b else '-' + _fmt(b)} {p}" for a, b, p in runs)


warn_once = LogOnce(log)  # one log line per distinct reason (a fallback to stock is logged once, never silent)


@dataclass(frozen=True)
class NodeLayout:
    """Where a group's ranks sit. nodes[i] = node of group rank i (= global rank // LOCAL_WORLD_SIZE)."""
    nodes: tuple[int, ...]
    counts: tuple[int, ...]  # group ranks on each node, nodes in order of first appearance
    contiguous: bool         # each node's ranks are consecutive group ranks
    balanced: bool           # every node holds as many group ranks

    @property
    def per_node(self) -> int | None:
        """G, the group ranks per node the hierarchical schedule uses; None where the layout allows none."""
        return self.counts[0] if self.contiguous and self.balanced else None

    def why_not(self) -> str:
        """Why hierarchical cannot run on this layout ("" where it can)."""
        if not self.contiguous:
            return (f"the group's ranks are not node-contiguous (node of each group rank: {list(self.nodes)}); "
                    f"the hierarchical schedule needs group rank = node * G + local")
        if not self.balanced:
            return (f"the group's nodes hold unequal rank counts {list(self.counts)} (node of each group rank: "
                    f"{list(self.nodes)}); the hierarchical schedule needs as many on every node")
        return ""


def node_layout(global_ranks: Sequence[int], local_world_size: int) -> NodeLayout:
    """The layout of a group whose group rank i is global rank global_ranks[i], L = local_world_size ranks
    per node of the job (node of global rank g = g // L)."""
    if local_world_size < 1:
        raise ValueError(f"LOCAL_WORLD_SIZE={local_world_size}: the job's ranks per node must be >= 1")
    if not global_ranks or min(global_ranks) < 0 or len(set(global_ranks)) != len(global_ranks):
        raise ValueError(f"node_layout: expected distinct non-negative global ranks, got {list(global_ranks)}")
    nodes = tuple(g // local_world_size for g in global_ranks)
    runs = [n for i, n in enumerate(nodes) if i == 0 or nodes[i - 1] != n]  # one entry per run of a node
    counts = tuple(nodes.count(n) for n in dict.fromkeys(nodes))
    return NodeLayout(nodes, counts, contiguous=len(runs) == len(set(runs)), balanced=len(set(counts)) == 1)


def is_decode_shaped(x: torch.Tensor) -> bool:
    """[1, b, h]: one new token per sequence (Megatron's [s, b, h] layout with a KV cache)."""
    return x.dim() == 3 and x.shape[0] == 1


def _reference_us(row: dict) -> float:
    """The stock collective's median: column `reference_us` (tables written before 0.2 call it `stock_us`)."""
    return row["reference_us"] if "reference_us" in row else row["stock_us"]


PAIRED_WINS = 0.8  # share of paired rounds ours must win (with 5 rounds: 4; a coin would do that 19 % of the time)


def _wins_rounds(row: dict, algo: str) -> bool:
    """Ours faster than stock in at least PAIRED_WINS of the rounds (round i of every candidate ran in the same
    interleaved round, under the same load); True where the table kept no rounds (older files: medians only)."""
    ours, ref = row.get(f"{algo}_rounds_us"), row.get("reference_rounds_us", row.get("stock_rounds_us"))
    if not ours or not ref or len(ours) != len(ref):
        return True
    return sum(o < r for o, r in zip(ours, ref)) >= PAIRED_WINS * len(ours)


def best_at(table: dict, nbytes: int) -> str | None:
    """Our fastest algorithm (by median) at the measured size nearest `nbytes` if it beat stock there: its median
    below stock's and, where the rounds are kept, faster in PAIRED_WINS of them (a noisy win stays stock: stock
    is never slower than stock). None otherwise, also outside the measured sizes (no extrapolation)."""
    rows = table["rows"]
    sizes = [r["bytes"] for r in rows]
    if not rows or not min(sizes) <= nbytes <= max(sizes):
        return None
    row = min(rows, key=lambda r: abs(math.log(r["bytes"]) - math.log(max(nbytes, 1))))
    ours = {a: row[f"{a}_us"] for a in ALL_REDUCE_ALGOS if f"{a}_us" in row}
    if not ours:
        return None
    algo = min(ours, key=ours.get)
    return algo if ours[algo] < _reference_us(row) and _wins_rounds(row, algo) else None


def _should_use_x(x: torch.Tensor, world: int, local_world_size: int | None, backend: str) -> bool:
    """Ours for decode-shaped inputs inside the calibrated window. Basis: the loaded calibration table."""
    return is_decode_shaped(x) and _pick(x, world, local_world_size, backend) is not None


def _pick(x: torch.Tensor, world: int, local_world_size: int | None, backend: str) -> str | None:
    if local_world_size is None:  # the layout allows no hierarchical schedule, so no table applies
        return None
    table = table_for(world, local_world_size, backend, dtype_name(x.dtype))
    if table is None:
        key = (world, local_world_size, str(backend), dtype_name(x.dtype))
        where = ("in the table file (add one with python -m megatron_flashoverlap.tools.calibrate_allreduce, or "
                 "unset the file to calibrate at start-up)") if _tables() else "measured yet (all_reduce() measures it)"
        warn_once(key, "all_reduce(algo='auto'): no calibration table for world_size=%d local_world_size=%d "
                       "backend=%s dtype=%s %s; using stock all-reduce", *key, where)
        return None
    return best_at(table, x.numel() * x.element_size())


def choose(x: torch.Tensor, world: int, local_world_size: int | None, backend: str) -> str:
    """The algorithm "auto" runs: ours where `_should_use_x`, else "reference" (also where the group's node
    layout gave no `local_world_size`: None)."""
    return _pick(x, world, local_world_size, backend) if _should_use_x(x, world, local_world_size, backend) \
        else "reference"
