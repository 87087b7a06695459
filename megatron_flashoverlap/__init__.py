"""megatron-flashoverlap: tail-free communication overlap for Megatron-Core.

Layers: schedules (data) <- runtime (one executor, the pipeline API) <- ops (operators by family, one
registry) <- megatron (the wing) <- bench <- faces.
Only the Megatron-facing modules import megatron; this package root imports torch only.
"""
from .ops import (ALGOS, AR_ALGOS, Attend, DPBucket, OpPlan, WgradRoute, all_gather_matmul, all_reduce,
                  force_reference, matmul_all_reduce, matmul_allreduce_dgrad, matmul_reduce_scatter,
                  matmul_wgrad_reduce_scatter, query_split_attention, ulysses_attention, ulysses_fused_attention)
from .runtime import OverlapContext, PeerTimeoutError, default_context

__version__ = "0.1.0"
__all__ = ["ALGOS", "AR_ALGOS", "Attend", "DPBucket", "OpPlan", "OverlapContext", "PeerTimeoutError", "WgradRoute",
           "all_gather_matmul", "all_reduce", "default_context", "force_reference", "matmul_all_reduce",
           "matmul_allreduce_dgrad", "matmul_reduce_scatter", "matmul_wgrad_reduce_scatter", "query_split_attention",
           "ulysses_attention", "ulysses_fused_attention"]
