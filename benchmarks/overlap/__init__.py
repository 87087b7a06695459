"""benchmarks/overlap/: run.py is the command (`python benchmarks/overlap/run.py --help`), RESULTS.md the
curated tables."""
