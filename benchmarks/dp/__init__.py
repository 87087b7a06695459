"""benchmarks/dp/: run.py is the command (`python benchmarks/dp/run.py --help`), RESULTS.md the
curated tables."""
