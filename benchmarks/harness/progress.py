"""A dependency-free progress bar for long sweeps (stderr, one line, redrawn in place on a terminal)."""
from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, total: int, label: str = "", enabled: bool = True, width: int = 30, stream=None):
        self.total, self.label, self.enabled, self.width = max(1, total), label, enabled, width
        self.done, self.t0, self.stream = 0, time.monotonic(), stream or sys.stderr
        self._last = -1.0

    def line(self) -> str:
        frac = min(1.0, self.done / self.total)
        fill = int(frac * self.width)
        el = time.monotonic() - self.t0
        eta = el / frac - el if frac > 0 else float("nan")
        return f"{self.label} [{'#' * fill}{'.' * (self.width - fill)}] {self.done}/{self.total} " \
               f"{el:.0f}s elapsed, ~{eta:.0f}s left"

    def tick(self, n: int = 1) -> None:
        self.done += n
        if not self.enabled:
            return
        now = time.monotonic()
        if self.done >= self.total or now - self._last > 2.0:
            self._last = now
            end = "\r" if self.stream.isatty() else "\n"
            self.stream.write(self.line() + end)
            self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.stream.isatty():
            self.stream.write("\n")
