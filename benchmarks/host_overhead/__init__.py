"""benchmarks/host_overhead/: run.py is the command (`python benchmarks/host_overhead/run.py --help`), RESULTS.md the
curated tables."""
