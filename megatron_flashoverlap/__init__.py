"""megatron-flashoverlap: tail-free communication overlap for Megatron-Core.

Layers: schedules (data) <- runtime (one executor, the pipeline API) <- ops (operators by family, one
registry) <- megatron (the wing); plan/ (the planner) prices the schedules without running them.
Only the Megatron-facing modules import megatron. The names below load on first use (PEP 562), so
`import megatron_flashoverlap.plan` (the planner's CLI) does not import torch.
"""
import importlib

_EXPORTS = {
    "ops": ("ALGOS", "AR_ALGOS", "Attend", "DPBucket", "OpPlan", "WgradRoute", "all_gather_matmul",
            "all_gather_matmul_fp8", "all_reduce", "force_reference", "matmul_all_reduce", "matmul_all_reduce_fp8",
            "matmul_allreduce_dgrad", "matmul_allreduce_dgrad_fp8", "matmul_reduce_scatter",
            "matmul_reduce_scatter_fp8", "matmul_wgrad_reduce_scatter",
            "query_split_attention", "ulysses_attention", "ulysses_fused_attention"),
    "runtime": ("DelayedScales", "Fp8Recipe", "OverlapContext", "PeerTimeoutError", "default_context"),
    "megatron.ddp.wrap": ("wrap_with_dp_overlap",),  # the DP entry: Megatron's DDP with fused wgrad rings
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}

__version__ = "0.3.0"
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'megatron_flashoverlap' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    globals()[name] = value  # once: later lookups do not come here
    return value


def __dir__():
    return sorted(set(globals()) | set(_WHERE))
