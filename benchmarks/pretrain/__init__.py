"""benchmarks/pretrain/: run.py is the command (`python benchmarks/pretrain/run.py --help`), RESULTS.md the
curated tables."""
