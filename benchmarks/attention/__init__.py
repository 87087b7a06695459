"""benchmarks/attention/: run.py is the command (`python benchmarks/attention/run.py --help`), RESULTS.md the
curated tables."""
