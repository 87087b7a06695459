"""Algorithm choice for the overlap operators, and the switch that routes every operator to its reference."""
from __future__ import annotations

import contextlib
import threading

ALGOS = ("flash", "flash_bidir", "slicing", "reference")
_state = threading.local()


@contextlib.contextmanager
def force_reference():
    """Inside this block every operator runs its unfused reference (collective, then GEMM)."""
    prev = getattr(_state, "forced", False)
    _state.forced = True
    try:
        yield
    finally:
        _state.forced = prev


def resolve(op: str, algo: str, num_chunks: int | None) -> tuple[str, int]:
    """The algorithm to run (the forced reference wins) and the slicing chunk count."""
    if algo not in ALGOS:
        raise ValueError(f"{op}: unknown algo {algo!r}; choose one of {ALGOS}")
    if getattr(_state, "forced", False):
        return "reference", 1
    if algo == "slicing":
        if num_chunks is None or int(num_chunks) < 1:
            raise ValueError(f"{op}: algo='slicing' needs num_chunks >= 1 (e.g. num_chunks=4)")
        return algo, int(num_chunks)
    return algo, 1
