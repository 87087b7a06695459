"""The explicit context that owns what overlap operators reuse: buffers, the wait timeout, a tracer.

One `OverlapContext` is created once (per process, or per layer set) and passed down; operators never
allocate their ring buffers per call. On CUDA the transfers of a step run on the communication stream
that ProcessGroupNCCL keeps for P2P: posting orders it after the current stream (an event), and
`work.wait()` makes the current stream wait for it (an event), so GEMM slices on the current stream
overlap the transfers without a host sync. On CPU/gloo the transfers progress on gloo's I/O threads.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch

from ..config import environment


def _default_timeout() -> timedelta:
    return timedelta(seconds=environment().timeout_s)


@dataclass
class TraceEvent:
    """One interval of the timeline: `what` is "compute", "post" or "wait"; `label` names the slice or step."""

    what: str
    label: str
    start: float
    end: float


@dataclass
class OverlapContext:
    """Reusable buffers keyed by (name, shape, dtype, device), the wait timeout, optional trace."""

    timeout: timedelta = field(default_factory=_default_timeout)
    check_peers: bool = True  # one small all-gather per call to catch ranks whose shapes disagree
    trace: list[TraceEvent] | None = None
    _buffers: dict = field(default_factory=dict)

    def buffer(self, name: str, shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A scratch tensor owned by the context: valid until the next request of the same key."""
        key = (name, tuple(shape), dtype, str(device))
        buf = self._buffers.get(key)
        if buf is None:
            buf = self._buffers[key] = torch.empty(shape, dtype=dtype, device=device)
        return buf

    def record(self, what: str, label: str, start: float) -> None:
        if self.trace is not None:
            self.trace.append(TraceEvent(what, label, start, time.perf_counter()))

    def clear(self) -> None:
        self._buffers.clear()


_DEFAULT: OverlapContext | None = None


def default_context() -> OverlapContext:
    """The process-wide context, created on first use."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = OverlapContext()
    return _DEFAULT
