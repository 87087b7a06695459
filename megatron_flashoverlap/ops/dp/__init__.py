"""Data parallel: the weight-gradient GEMM fused with its reduce-scatter over the DP group."""
from .wgrad_rs import DPBucket, matmul_wgrad_reduce_scatter

__all__ = ["DPBucket", "matmul_wgrad_reduce_scatter"]
