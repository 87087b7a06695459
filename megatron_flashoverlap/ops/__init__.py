"""Overlap operators: plain functions per algorithm, autograd.Functions, public wrappers."""
from .algo import ALGOS, force_reference
from .all_reduce import AR_ALGOS, all_reduce
from .functions import all_gather_matmul, matmul_reduce_scatter

__all__ = ["ALGOS", "AR_ALGOS", "all_gather_matmul", "all_reduce", "force_reference", "matmul_reduce_scatter"]
