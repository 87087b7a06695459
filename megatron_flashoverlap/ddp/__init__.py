"""Data-parallel gradient reduce-scatter inside the weight-gradient GEMM, for Megatron-Core DDP.

    wgrad_rs.py        the operator (no Megatron): matmul_wgrad_reduce_scatter, flash and reference
    megatron_ddp.py    every Megatron DDP internal touched (bucket isolation, start_grad_sync), version-checked
    linear.py          the linear autograd path that calls dp_wgrad; wrap_with_dp_overlap(config, ddp_config, module)
    cpu_optimizer.py   CPU/gloo shims for Megatron's DistributedOptimizer (tests and benchmarks only)

Only this package's megatron_ddp / linear / cpu_optimizer modules import megatron (lazily).
"""
from .wgrad_rs import matmul_wgrad_reduce_scatter

__all__ = ["matmul_wgrad_reduce_scatter"]
