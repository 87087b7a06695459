"""Worker-side bodies of the decode all-reduce's measurement tests (tests/gloo/test_allreduce_startup.py)."""
from __future__ import annotations

import logging
import os
import time

import torch

import megatron_flashoverlap as fo
from megatron_flashoverlap.ops.all_reduce import choose, select
from megatron_flashoverlap.plan.chooser import chooser_of
from megatron_flashoverlap.runtime import OverlapContext
from tests.support.chooser import active
from tests.support.loglines import Lines


def _auto(x):
    """One auto call -> (ours ran: the executor traced a walk, out)."""
    ctx = OverlapContext(check_peers=False, trace=[])
    out = fo.all_reduce(x, algo="auto", context=ctx)
    return bool(ctx.trace), out


def _slowed(rank, slow):
    """choose.py's registry lookup, with `slow` = (algo, rank, seconds): that algorithm sleeps on that rank."""
    plain = choose.plain

    def lookup(op, algo):
        fn = plain(op, algo)
        if slow is None or algo != slow[0] or rank != slow[1]:
            return fn

        def late(*args):
            time.sleep(slow[2])
            return fn(*args)
        return late
    return lookup


def startup(rank, world, local, shape, table=None, slow=None):
    """LOCAL_WORLD_SIZE=local; a prefill-shaped auto call, then two decode-shaped ones of `shape`.
    -> what the test checks (the decisions this rank holds, the log lines, the path taken, exactness)."""
    os.environ["LOCAL_WORLD_SIZE"] = str(local)
    lines = Lines()
    logging.getLogger("megatron_flashoverlap.ops").addHandler(lines)
    select.warn_once.clear()
    saved = choose.plain
    choose.plain = _slowed(rank, slow)
    try:
        with active(table=table) as cfg:
            chooser = chooser_of(cfg)
            x = torch.full(shape, float(rank + 1))
            prefill_ours = _auto(torch.ones((2,) + tuple(shape[1:])))[0]
            before = dict(chooser.decided)
            ours, out = _auto(x)  # measures its bucket first (outside the trace), then runs what it chose
            again, out2 = _auto(x)
            decided = {k.word: (c.pick, c.source, c.reason, dict(c.medians_us)) for k, c in chooser.decided.items()}
        return {"decided": decided, "before": (prefill_ours, before), "ours": ours, "again": again,
                "exact": bool(torch.equal(out, torch.full(shape, world * (world + 1) / 2))),
                "same_again": bool(torch.equal(out, out2)), "lines": lines.lines}
    finally:
        choose.plain = saved
        os.environ.pop("LOCAL_WORLD_SIZE", None)
        logging.getLogger("megatron_flashoverlap.ops").removeHandler(lines)
