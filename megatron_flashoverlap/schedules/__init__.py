"""Schedules as data (no torch.distributed): builders, a dry-run validator and a grid printer."""
from .allreduce import (
    ALL_REDUCE, ALL_REDUCE_SCHEDULES, AllReduceWord, all_reduce_hierarchical, all_reduce_hierarchical_hd, all_reduce_hierarchical_pipelined, all_reduce_recursive_doubling, all_reduce_ring, all_reduce_schedule,
)
from .alltoall import all_to_all_consume, all_to_all_produce, expert_pipeline
from .grid import grid
from .ring import all_gather_ring, reduce_scatter_ring, ring_tail
from .step import Schedule, Slice, Step, Transfer, merge
from .validate import ScheduleError, validate

__all__ = [
    "ALL_REDUCE", "ALL_REDUCE_SCHEDULES", "AllReduceWord", "all_reduce_hierarchical", "all_reduce_hierarchical_hd", "all_reduce_hierarchical_pipelined", "all_reduce_recursive_doubling", "all_reduce_ring",
    "all_reduce_schedule",
    "Schedule", "ScheduleError", "Slice", "Step", "Transfer", "all_gather_ring", "all_to_all_consume",
    "all_to_all_produce", "expert_pipeline", "grid", "merge", "reduce_scatter_ring", "ring_tail", "validate",
]
