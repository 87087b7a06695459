"""Test support (tests only, never installed): the persistent gloo worker pool and a profiler helper."""
from .pool import Pool, WorkerError, WorkerTimeout

__all__ = ["Pool", "WorkerError", "WorkerTimeout"]
