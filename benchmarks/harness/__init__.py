"""The benchmark harness (a source checkout's, never installed): what every benchmarks/NAME/run.py shares.

    launch.py        THE rank launcher (`run_ranks`: torchrun, optional shaped namespace, JSON results); finds
                     the checkout's root from its own path (the ranks import benchmarks/ and the package from it)
    netns.py         network namespaces with a tbf-shaped loopback
    topology.py      a two-level topology in one namespace: nodes as loopback addresses, htb between them,
                     the LD_PRELOAD source-binding shim (bind_source.c)
    estimator.py     THE estimator (medians over interleaved rounds, bootstrap intervals over rounds)
    verdict.py       win / tie / LOSS words: a win only where the interval excludes 1.0
    blocks.py        the benchmarked TP blocks (MLP, attention) and their methods (stock, slicing k, flash)
    timing.py        block, compute alone (torch's fake group), comm alone: one row per method and mode
    megatron_rows.py the real Megatron MLP and DDP rows (the harness's Megatron importer)
    line_rate_rs.py  stock's reduce-scatters on gloo at line rate (gloo's own moves an all-reduce's bytes)
    wire.py          what a call sends: dtype and bytes of every c10d send (`Sends`)
    progress.py      one progress line on stderr
    cli.py           every run.py's parser (the checkout note), default --out, --render

The one timing loop (`interleaved`, `timed`, `rank_max`, `pass_seconds`, `cuda_timed`) is the package's
megatron_flashoverlap/runtime/timing.py: the all-reduce calibration a user runs needs it too.
"""
