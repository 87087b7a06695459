"""Tensor parallel with sequence parallel: all-gather + GEMM (column) and GEMM + reduce-scatter (row). plain.py: the
plain functions of every algorithm, forward and backward; plain_fp8.py: their FP8 twins; autograd.py: the
autograd.Functions and the public wrappers."""
