"""The explicit context that owns what overlap operators reuse: buffers, the wait timeout, the peer checks
already passed, a tracer.

One `OverlapContext` is created once (per process, or per layer set) and passed down; operators never
allocate their ring buffers per call. How a walk waits on its transfers depends on the group's backend
(runtime/transport.py): on NCCL a wait only orders the current stream after NCCL's (no host sync, and
`timeout` is not used: the process group's own timeout and watchdog catch a dead peer); on gloo every
wait ends at the group's own timeout, or at `timeout` where that is smaller (None: the group's alone).

Buffers, by size class: a request (name, shape, dtype, device) is a view of one flat storage per
(name, dtype, device), whose length is the element count rounded up to its size class (1/8 steps:
n <= 16 -> 16, else the next multiple of 2**(bit_length(n) - 4)). A larger request replaces the storage,
a smaller one reuses it. Cap: the context holds, per (name, dtype, device), at most 9/8 of the bytes of
the largest request of that key (plus 16 elements), so however many sequence lengths pass through, it
holds at most 9/8 of what one call at the largest shape needs (`held_bytes()`). A buffer is valid until
the next request of the same name (any shape): names carry the ring slot, so the two slots a walk
rotates through never alias.

Peer checks (`check_peers`): "once" (default) runs the peer-agreement all-gather once per (group, op,
shape facts) and remembers it; "always" runs it on every call; "never" skips it (True / False are the
old spellings of "always" / "never").
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch

from ..config import environment

CHECK_PEERS = ("once", "always", "never")
_CHECKED_PER_GROUP = 1024  # shape facts remembered per group; past that the group's set starts over


def _default_timeout() -> timedelta | None:
    seconds = environment().timeout_s
    return None if seconds is None else timedelta(seconds=seconds)


def size_class(n: int) -> int:
    """Elements a flat storage holds for a request of n: n rounded up in 1/8 steps (at least 16)."""
    if n <= 16:
        return 16
    step = 1 << (n.bit_length() - 4)
    return -(-n // step) * step


@dataclass
class TraceEvent:
    """One interval of the timeline: `what` is "compute", "post" or "wait"; `label` names the slice or step."""

    what: str
    label: str
    start: float
    end: float


@dataclass
class OverlapContext:
    """Reusable buffers by size class, the gloo wait bound, the peer checks passed, optional trace."""

    timeout: timedelta | None = field(default_factory=_default_timeout)
    check_peers: str | bool = "once"  # "once" | "always" | "never" (module docstring)
    trace: list[TraceEvent] | None = None
    _buffers: dict = field(default_factory=dict, repr=False)
    _agreed: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        if isinstance(self.check_peers, bool):
            self.check_peers = "always" if self.check_peers else "never"
        if self.check_peers not in CHECK_PEERS:
            raise ValueError(f"OverlapContext(check_peers={self.check_peers!r}): choose one of {CHECK_PEERS}")

    def buffer(self, name: str, shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A scratch tensor [shape] owned by the context: valid until the next request of `name`."""
        if type(shape) is not tuple:
            shape = tuple(shape)
        key = (name, dtype, device)
        entry = self._buffers.get(key)
        if entry is not None and entry[1] == shape:
            return entry[2]
        n = 1
        for d in shape:
            n *= d
        # never an inference tensor or view: a buffer first asked for under torch.inference_mode (Megatron's
        with torch.inference_mode(False):  # inference engine) is written in place by training after it
            flat = entry[0] if entry is not None and entry[0].numel() >= n else \
                torch.empty(size_class(n), dtype=dtype, device=device)
            view = flat[:n].view(shape)
        self._buffers[key] = (flat, shape, view)
        return view

    def held_bytes(self) -> int:
        """Bytes of every buffer storage the context holds now."""
        return sum(flat.numel() * flat.element_size() for flat, _, _ in self._buffers.values())

    def agreed(self, group, key: tuple) -> bool:
        """Whether the peers of `group` already agreed on `key` (op, shape facts) under "once"."""
        return self.check_peers == "once" and key in self._agreed.get(group, ())

    def remember_agreed(self, group, key: tuple) -> None:
        seen = self._agreed.setdefault(group, set())
        if len(seen) >= _CHECKED_PER_GROUP:  # every rank of the group sees the same calls: same reset
            seen.clear()
        seen.add(key)

    def forget_peer_checks(self) -> None:
        """Forget the agreed shapes: the next call of each runs the check again. Call it on every rank of the
        groups at the same point (one rank forgetting alone would wait in a check its peers skip)."""
        self._agreed.clear()

    def record(self, what: str, label: str, start: float) -> None:
        if self.trace is not None:
            self.trace.append(TraceEvent(what, label, start, time.perf_counter()))

    def clear(self) -> None:
        """Drop the buffers (the agreed peer checks stay: see forget_peer_checks)."""
        self._buffers.clear()


# The package's one context factory: a use -> (its peer check, one per process?, one per timeout?).
#   default  operators called without a context: peer checks "once"; one per process (a fork inherits it)
#   layer    the Flash layers (megatron/): per-call peer check off (a layer checks its peers once per input
#            shape instead: steady-state steps issue no collective besides the ring); one per timeout
#   worker   the DP worker thread (megatron/ddp/worker.py): its own buffers (not the compute thread's), no peer
#            check (the compute thread checked before queuing the ring); one per process id (a fork does not
#            inherit threads), with the timeout of its first caller
USES = {"default": ("once", False, False), "layer": ("never", False, True), "worker": ("never", True, False)}
_SHARED: dict[tuple, OverlapContext] = {}


def shared_context(use: str = "default", timeout_s: float | None = None) -> OverlapContext:
    """The context every caller of `use` shares (USES above), created on first use; timeout_s None: the
    environment's bound (config.environment(); unset: each group's own timeout alone)."""
    if use not in USES:
        raise ValueError(f"shared_context(use={use!r}): choose one of {tuple(USES)}")
    check_peers, per_process, per_timeout = USES[use]
    key = (use, os.getpid() if per_process else None, timeout_s if per_timeout else None)
    if key not in _SHARED:
        if per_process:  # another process's context (before a fork) is not ours: drop it
            for stale in [k for k in _SHARED if k[0] == use]:
                del _SHARED[stale]
        kw = {} if timeout_s is None else {"timeout": timedelta(seconds=timeout_s)}
        _SHARED[key] = OverlapContext(check_peers=check_peers, **kw)
    return _SHARED[key]


def default_context() -> OverlapContext:
    """The process-wide context for operators called without one, created on first use."""
    return shared_context("default")
