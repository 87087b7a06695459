"""What goes on the wire: the dtype and bytes of every tensor a call hands to c10d's send op.

    with Sends() as m:
        y = fo.all_gather_matmul(x_shard, w_shard, plan=plan)
    m.sent                       [(dtype name, bytes), ...] in send order (numel * element_size)
    m.bytes(dtype=None)          their sum (of one dtype: "torch.uint8", ...)

A TorchDispatchMode that observes torch.distributed and then runs the real op: it replaces nothing. Modes are
thread-local, so while one is active the runtime posts its transfers from the calling thread
(runtime/commthread.py `threaded`): the bytes are the same either way, the timing is not (time outside it).
"""
from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode


class Sends(TorchDispatchMode):
    """Records (dtype, bytes) of every tensor passed to c10d.send while active."""

    def __init__(self):
        super().__init__()
        self.sent: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func).startswith("c10d.send"):
            for t in args[0]:  # send(tensors, group, dst, tag)
                self.sent.append((str(t.dtype), t.numel() * t.element_size()))
        return func(*args, **(kwargs or {}))

    def bytes(self, dtype: str | None = None) -> int:
        return sum(n for d, n in self.sent if dtype is None or d == dtype)
