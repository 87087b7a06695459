"""benchmarks/topology/: run.py is the command (`python benchmarks/topology/run.py --help`), RESULTS.md the
curated tables."""
