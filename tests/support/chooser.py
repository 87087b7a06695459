"""An activated flash-overlap config for the length of a test body (its chooser is fresh: nothing decided yet).

    with active({"all_reduce": {"decode": "ring"}}, table={"tables": [...]}) as cfg:
        ...                                   # fo.all_reduce(algo="auto") and the layers choose by cfg's chooser
`table`: a calibration-format dict, written to a temporary file that all_reduce.table names.
"""
from __future__ import annotations

import contextlib
import json
import os
import tempfile

from megatron_flashoverlap import config


@contextlib.contextmanager
def active(yaml: dict | None = None, table: dict | None = None):
    data = {k: dict(v) if isinstance(v, dict) else v for k, v in (yaml or {}).items()}
    path = None
    if table is not None:
        fd, path = tempfile.mkstemp(suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(table, f)
        data.setdefault("all_reduce", {})["table"] = path
    cfg = config.from_dict(data, config.Environment())
    previous = config.activate(cfg)
    try:
        yield cfg
    finally:
        config.activate(previous)
        if path is not None:
            os.unlink(path)
