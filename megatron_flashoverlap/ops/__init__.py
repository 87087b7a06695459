"""Overlap operators by family (tp_sp, tp_nosp, all_reduce, attention, dp, moe): in each family folder its plain
functions (one per algorithm, one signature), reference, autograd.Function and public wrapper side by side;
`registry` holds the algorithm words per operator, the dispatch tables, `force_reference()` and the settings
objects of the GEMM operators (OpPlan: the algorithm and its knobs; WgradRoute: where dW goes); `choose` the
chooser's measured tier every family's choice settles through (plan/chooser.py holds the rule)."""
from .registry import ALGOS, OpPlan, WgradRoute, force_reference
from .attention.core import Attend
from .all_reduce.all_reduce import AR_ALGOS, all_reduce
from .attention.query_split import query_split_attention
from .attention.ulysses import ulysses_attention
from .attention.ulysses_fused import ulysses_fused_attention
from .dp.wgrad_rs import DPBucket, matmul_wgrad_reduce_scatter
from .moe.exchange import expert_all_to_all
from .tp_nosp.autograd import (matmul_all_reduce, matmul_all_reduce_fp8, matmul_allreduce_dgrad,
                                        matmul_allreduce_dgrad_fp8)
from .tp_sp.autograd import all_gather_matmul, all_gather_matmul_fp8, matmul_reduce_scatter, matmul_reduce_scatter_fp8

__all__ = ["ALGOS", "AR_ALGOS", "Attend", "DPBucket", "OpPlan", "WgradRoute", "all_gather_matmul", "all_gather_matmul_fp8",
           "all_reduce",
           "expert_all_to_all", "force_reference", "matmul_all_reduce", "matmul_all_reduce_fp8",
           "matmul_allreduce_dgrad", "matmul_allreduce_dgrad_fp8",
           "matmul_reduce_scatter", "matmul_reduce_scatter_fp8", "matmul_wgrad_reduce_scatter", "query_split_attention",
           "ulysses_attention",
           "ulysses_fused_attention"]
