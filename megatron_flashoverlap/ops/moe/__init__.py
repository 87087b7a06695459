"""MoE expert parallelism: the alltoall dispatcher's token exchange (all-to-all-v) as pairwise steps, and the
fused expert pipeline (dispatch, experts per source block, combine in one walk)."""
from .exchange import DISPATCH, COMBINE, expert_all_to_all
from .fused import LocalExperts, expert_pipeline

__all__ = ["COMBINE", "DISPATCH", "LocalExperts", "expert_all_to_all", "expert_pipeline"]
