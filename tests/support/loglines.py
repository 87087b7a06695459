"""A logging handler that keeps the messages it sees, for the worker bodies that assert on log lines.

    Lines(level=logging.NOTSET).lines -> [str]     record.getMessage() of every record at or above `level`
"""
from __future__ import annotations

import logging


class Lines(logging.Handler):
    def __init__(self, level: int = logging.NOTSET):
        super().__init__(level)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())
