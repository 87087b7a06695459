"""Tensor parallel with sequence parallel: all-gather + GEMM (column) and GEMM + reduce-scatter (row)."""
