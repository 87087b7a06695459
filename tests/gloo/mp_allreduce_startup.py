"""Worker-side bodies of the start-up calibration tests (tests/gloo/test_allreduce_startup.py)."""
from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist

import megatron_flashoverlap as fo
from megatron_flashoverlap.ops.all_reduce import calibrate, select
from megatron_flashoverlap.runtime import OverlapContext
from tests.support.loglines import Lines as _Lines




def _auto(x, ctx_trace: bool = True):
    """One auto call -> (ours ran: the executor traced a walk, out)."""
    ctx = OverlapContext(check_peers=False, trace=[])
    out = fo.all_reduce(x, algo="auto", context=ctx)
    return bool(ctx.trace), out


def startup(rank, world, local, shape, sizes=None, table=None):
    """LOCAL_WORLD_SIZE=local; no table file (or `table`, an override); two decode-shaped auto calls and one
    prefill-shaped one. -> what the test checks (the table every rank holds, the log lines, the path taken)."""
    os.environ["LOCAL_WORLD_SIZE"] = str(local)
    lines = _Lines()
    logging.getLogger("megatron_flashoverlap.ops.all_reduce").addHandler(lines)
    saved = calibrate.SIZES
    calibrate.SIZES = tuple(sizes) if sizes else saved
    select.set_calibration(table)
    select.warn_once.clear()
    try:
        x = torch.full(shape, float(rank + 1))
        prefill = torch.ones((2,) + tuple(shape[1:]))
        measured_before_prefill = _auto(prefill)[0], dict(select._MEASURED)
        ours, out = _auto(x)  # measures first (outside the trace), then runs what it chose
        again, out2 = _auto(x)
        key = (world, local, "gloo", "float32")
        return {"table": select._MEASURED.get(key), "before": measured_before_prefill,
                "ours": ours, "again": again, "exact": bool(torch.equal(out, torch.full(shape, world * (world + 1) / 2))),
                "same_again": bool(torch.equal(out, out2)), "lines": lines.lines,
                "best": select.best_at(select.table_for(*key), x.numel() * 4) if select.table_for(*key) else None}
    finally:
        calibrate.SIZES = saved
        select.set_calibration(None)
        os.environ.pop("LOCAL_WORLD_SIZE", None)
        logging.getLogger("megatron_flashoverlap.ops.all_reduce").removeHandler(lines)
