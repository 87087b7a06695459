"""Tensor parallel without sequence parallel: GEMM + all-reduce (row forward, column dgrad)."""
