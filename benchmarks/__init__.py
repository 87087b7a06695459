"""Benchmarks: run from a source checkout, never installed (`pip install .` ships megatron_flashoverlap/ only).

    harness/         what every benchmark shares: netns + tbf / htb topology, the one launcher, the estimator,
                     the verdict, the line-rate stock reduce-scatter, the TP blocks, the CLI and --render
    overlap/         TP + SP blocks: stock vs data slicing vs flash over a shaped link
    pretrain/        Megatron's own training loop end to end (the project entry), stock vs --flash-overlap
    dp/              DP gradient reduce-scatter in the wgrad GEMM vs Megatron's --overlap-grad-reduce
    moe/             one Megatron MoE layer: the fused expert pipeline vs stock's all-to-all
    attention/       query-split attention and the fused Ulysses all-to-all vs stock
    topology/        the decode all-reduce on an emulated two-level topology (nodes, htb between them)
    host_overhead/   host cost per call and per ring step on torch's fake process group
    gpu_check/       one prepared GPU check (operators without host syncs, slicing cost, CUDA graphs, NCCL)

Each folder: run.py (the command: `python benchmarks/NAME/run.py --help`), its rank side, its table writer,
RESULTS.md (the current tables, their commands and plots) and data/ (the raw samples the tables are rendered
from: `run.py --render data/X_raw.json` rebuilds data/X.md).
"""
