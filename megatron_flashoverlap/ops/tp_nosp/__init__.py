"""Tensor parallel without sequence parallel: GEMM + all-reduce (row forward, column dgrad). plain.py: the plain
functions of every algorithm; plain_fp8.py: their FP8 twins; autograd.py: the autograd.Functions and the public
wrappers; choose.py: the prefill chooser's measured pick."""
