"""What the pool's forkserver imports once, so that every worker forked from it starts with torch and
megatron-core already imported (tests/support/pool.py). Nothing of the package or of the tests: a worker's shims,
mutations and configs happen in the worker. OMP_NUM_THREADS first: the OpenMP runtime reads it when torch loads it."""
import os

os.environ["OMP_NUM_THREADS"] = "1"

try:  # a failed preload only costs the workers their own imports (the forkserver must not die of it)
    import torch  # noqa: E402,F401
    import megatron.core  # noqa: F401
    import megatron.core.models.gpt  # noqa: F401
except Exception:  # noqa: BLE001
    pass
