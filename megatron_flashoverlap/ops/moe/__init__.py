"""MoE expert parallelism: the alltoall dispatcher's token exchange (all-to-all-v) as pairwise steps."""
from .exchange import DISPATCH, COMBINE, expert_all_to_all

__all__ = ["COMBINE", "DISPATCH", "expert_all_to_all"]
