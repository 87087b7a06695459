"""Test support (tests only, never installed): the persistent gloo worker pool, a profiler helper, and the shared
pretrain() start-up (pretrain_runs.py, the caller; pretrain_runner.py, the rank side)."""
from .pool import Pool, WorkerError, WorkerTimeout

__all__ = ["Pool", "WorkerError", "WorkerTimeout"]
