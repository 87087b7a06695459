"""benchmarks/fp8/: run.py is the command (`python benchmarks/fp8/run.py --help`), RESULTS.md the curated tables."""
