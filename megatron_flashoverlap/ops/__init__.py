"""Overlap operators: plain functions per algorithm, autograd.Functions, public wrappers."""
from .registry import ALGOS, force_reference
from .all_reduce.all_reduce import AR_ALGOS, all_reduce
from .tp_nosp.all_reduce_matmul import matmul_all_reduce, matmul_allreduce_dgrad
from .attention.query_split import query_split_attention
from .tp_sp.functions import all_gather_matmul, matmul_reduce_scatter
from .attention.ulysses import ulysses_attention
from .attention.ulysses_fused import ulysses_fused_attention

__all__ = ["ALGOS", "AR_ALGOS", "all_gather_matmul", "all_reduce", "force_reference", "matmul_all_reduce",
           "matmul_allreduce_dgrad", "matmul_reduce_scatter", "query_split_attention", "ulysses_attention",
           "ulysses_fused_attention"]
