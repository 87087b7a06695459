"""MoE expert parallelism: exchange.py (the alltoall dispatcher's token exchange, all-to-all-v, as pairwise steps),
fused.py (the fused expert pipeline: dispatch, experts per source block, combine in one walk), choose.py (the
exchange's measured pick)."""
from .exchange import DISPATCH, COMBINE, expert_all_to_all
from .fused import LocalExperts, expert_pipeline

__all__ = ["COMBINE", "DISPATCH", "LocalExperts", "expert_all_to_all", "expert_pipeline"]
