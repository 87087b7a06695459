"""benchmarks/gpu_check/: run.py is the command (`python benchmarks/gpu_check/run.py --help`), RESULTS.md the
curated tables."""
