"""The Megatron wing: every module that imports megatron lives here, and no other module does.

    linear.py, attention.py    drop-in Megatron-Core layers (TP linears, core attentions)
    spec.py                    the layer spec and its provider (`--spec megatron_flashoverlap.spec ...`)
    ddp.py, ddp_linear.py      DP gradient reduce-scatter inside the wgrad GEMM, on Megatron's DDP
    cpu.py, cpu_optimizer.py   shims that run Megatron-Core on CPU over gloo
    args.py, launch.py         the `--flash-overlap` flags and the launcher for Megatron-LM's scripts
    testing.py                 Megatron helpers for tests, examples and benchmarks
"""
