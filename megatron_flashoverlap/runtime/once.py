"""The package's one "say it once" helper: a fallback, a refusal turned stock, a chosen path is said once per
reason and process, never silently and never per call.

    LogOnce(out, level=logging.WARNING)    the keys already said (a set: a test may clear() it) and the call
        said = LogOnce(log)  ...  said(key, msg, *args) -> True the first time `key` is seen: `msg % args` goes
        to `out` (a logging.Logger at `level`, the record naming the caller's line; or a callable taking the
        line, e.g. print_rank0); msg None: the key is the line
    print_rank0(line)                      print on rank 0 only, from $RANK (torch.distributed may not be up:
                                           Megatron's argument parsing), flushed
"""
from __future__ import annotations

import logging
import os


class LogOnce(set):
    """The keys already said; calling it says a line once per key (module docstring)."""

    def __init__(self, out, level: int = logging.WARNING):
        super().__init__()
        self.out, self.level = out, level

    def __call__(self, key, msg: str | None = None, *args) -> bool:
        if key in self:
            return False
        self.add(key)
        line = key if msg is None else msg
        if isinstance(self.out, logging.Logger):
            self.out.log(self.level, line, *args, stacklevel=2)  # the record names the caller's line
        else:
            self.out(line % args if args else line)
        return True


def print_rank0(line: str) -> None:
    """The line on stdout, flushed, on rank 0 only ($RANK; 0 where unset)."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(line, flush=True)
