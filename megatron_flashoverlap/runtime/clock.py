"""A device clock for the timings the package itself takes (the start-up probe) and the benchmarks' loop.

    cuda_timed(fn) -> seconds of one fn() between two CUDA events on the current stream (one device, no barrier)
"""
from __future__ import annotations

from typing import Callable

import torch


def cuda_timed(fn: Callable[[], object]) -> float:
    """Seconds of one fn() between two CUDA events on the current stream (no barrier; one device)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3
