"""Overlap operators: plain functions per algorithm, autograd.Functions, public wrappers."""
from .algo import ALGOS, force_reference
from .functions import all_gather_matmul, matmul_reduce_scatter

__all__ = ["ALGOS", "all_gather_matmul", "force_reference", "matmul_reduce_scatter"]
