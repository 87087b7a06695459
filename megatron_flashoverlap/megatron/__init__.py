"""The Megatron wing: every module that imports megatron lives here, and no other module does.

    linear.py, attention.py    drop-in Megatron-Core layers (TP linears, core attentions)
    spec.py                    the layer spec and its provider (`--spec megatron_flashoverlap.spec ...`)
    structure.py               what of Megatron's model structure the spec builds as stock, what it refuses
    sites.py                   the GEMM sites line: what each site of each layer kind runs, and why
    ddp.py, ddp_linear.py      DP gradient reduce-scatter inside the wgrad GEMM, on Megatron's DDP
    ddp_entry.py               ... and under pretrain() with --flash-overlap (its DDP class becomes ours)
    cpu.py                     shims that run Megatron (core and its training loop) on CPU over gloo: enable()
    args.py, launch.py         the `--flash-overlap` flags and the launcher for Megatron-LM's scripts (`--cpu`)
    pretrain_gpt.py            the project entry: Megatron's pretrain() with our spec on mock data
    testing.py                 Megatron helpers for tests, examples and benchmarks
"""
