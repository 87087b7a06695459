"""Test support shipped with the package: the persistent gloo worker pool."""
from .pool import Pool, WorkerError, WorkerTimeout

__all__ = ["Pool", "WorkerError", "WorkerTimeout"]
