"""Where a group's ranks sit, and the decode shape: what the decode all-reduce's choice keys on.

The choice itself is plan/chooser.py's (the rule, the precedence, the table object) from the measurement of
choose.py; `best_at` reads a calibration table by that rule, `choices` prints a table's picks per size.

Node layout: LOCAL_WORLD_SIZE = L ranks per node of the whole job, so global rank g sits on node g // L.
A group's ranks, in group-rank order, are node-contiguous when each node's ranks are consecutive group
ranks, and balanced when every node holds as many (G); the hierarchical schedule needs both
(group rank = node * G + local).
"""
from __future__ import annotations

import logging

from dataclasses import dataclass
from typing import Sequence

import torch

from ...runtime.once import LogOnce
from ...plan.chooser import best_at  # noqa: F401 - the rule on a calibration table, read here by its users

log = logging.getLogger(__name__)


def dtype_name(dtype: torch.dtype) -> str:
    """The table's dtype key: torch.bfloat16 -> "bfloat16"."""
    return str(dtype).replace("torch.", "")


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
