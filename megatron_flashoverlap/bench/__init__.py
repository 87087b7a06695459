"""Benchmark harness: emulated interconnect (netns + tbf), one timing loop, one launcher, cost model, reports.

    rounds.py        THE timing loop (`interleaved`: variants once per round, warm-up dropped) and its clocks
    launch.py        THE rank launcher (`run_ranks`: torchrun, optional shaped namespace, JSON results)
    netns.py         network namespaces with a shaped loopback
    blocks.py attention_blocks.py   the benchmarked TP blocks (MLP, attention, query-split, Ulysses)
    timing.py worker.py report.py costmodel.py progress.py   the overlap sweep (benchmarks/overlap.py)
    dp_rows.py megatron_rows.py attention_rows.py topology.py gpu_check.py calibrate_allreduce.py
                     rank sides of the other benchmarks/*.py (megatron_rows.py: bench's one megatron importer)
"""
