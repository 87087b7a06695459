"""Data parallelism on Megatron's DDP: the weight gradient reduce-scattered over DP inside its wgrad GEMM.

    linear.py       the Megatron linear whose dW goes through `dp_wgrad`; `wrap_with_dp_overlap`, the one call
    grad_sync.py    every Megatron-Core DDP internal touched: the bucket's grad sync, `enable_dp_overlap`, `dp_wgrad`
    layout.py       where the fused weights sit in Megatron's gradient buffer (a bucket each)
    choice.py       the automatic choice of the fused linears (calibrated cost model) and of the rings' placement
    worker.py       the DP worker thread: the fused ring off the compute thread on gloo
    pretrain.py     under pretrain() with --flash-overlap: its DDP class becomes ours
"""
