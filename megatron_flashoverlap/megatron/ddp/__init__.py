"""Data parallelism on Megatron's DDP: the weight gradient reduce-scattered over DP inside its wgrad GEMM.

    wrap.py         `wrap_with_dp_overlap`, the one call; the Megatron linear whose dW goes through `dp_wgrad`
    grad_sync.py    every Megatron-Core DDP internal touched: the bucket's grad sync, `enable_dp_overlap`, `dp_wgrad`
    layout.py       where the fused weights sit in Megatron's gradient buffer (a bucket each)
    auto_fuse.py    dp.fuse: auto, the fused linears (plan/dp.py's model on measured rates) and the rings' placement
    worker.py       the DP worker thread: the fused ring off the compute thread on gloo
    pretrain.py     under pretrain() with --flash-overlap: its DDP class becomes ours
"""
