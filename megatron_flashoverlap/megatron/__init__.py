"""The Megatron wing: every module that imports megatron lives here, and no other module does.

    linear.py, attention.py    drop-in Megatron-Core layers (TP linears, core attentions)
    norm.py, sdpa.py           sequence-parallel norms; core attention on torch SDPA, and which one a spec builds
    spec.py                    the layer spec and its provider (`--spec megatron_flashoverlap.spec ...`), and
                               how stock reads --moe-layer-freq, so the spec builds the same layer kinds
    sites.py                   the GEMM sites line: what each site of each layer kind runs, and why
    step_kind.py               the step kind a forward tells its row linears (train / prefill / decode / mixed),
                               and the inference token buckets the chooser decides at the first step
    train_choice.py            an `auto` layer's training step: stock or flash (flash_c2), measured by the chooser
    probe.py                   the start-up probe: GEMMs and hops timed on the real group, for the planner
    ddp/                       DP gradient reduce-scatter inside the wgrad GEMM, on Megatron's DDP, and under
                               pretrain() with --flash-overlap (its DDP class becomes ours)
    moe/                       MoE layers with our exchange or the fused expert pipeline
    cpu.py                     shims that run Megatron (core and its training loop) on CPU over gloo: enable()
    cpu_flash_attn.py          flash-attn 2's varlen / kvcache entry points in torch (the dynamic engine on CPU)
    cli/                       the `--flash-overlap` flags, the launcher for Megatron-LM's scripts (`--cpu`), and
                               the project entry (Megatron's pretrain() with our spec on mock data)
    models.py                  small real Megatron GPT models on CPU/gloo ranks, for examples, benchmarks and tests
"""
