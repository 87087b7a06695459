"""benchmarks/moe/: run.py is the command (`python benchmarks/moe/run.py --help`), RESULTS.md the
curated tables."""
