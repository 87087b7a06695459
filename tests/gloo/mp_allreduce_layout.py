"""Worker-side bodies of the node-layout tests of all_reduce (run on every rank of an 8-rank gloo pool).

Each case is a subgroup (global ranks) and a LOCAL_WORLD_SIZE, set in the environment as torchrun would.
Member q contributes `_contribution(seed, q, ...)`, so every member can build the exact float64 sum.
"""
from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist

import megatron_flashoverlap as fo
from megatron_flashoverlap.ops.all_reduce import select
from megatron_flashoverlap.runtime import OverlapContext
from tests.gloo.mp_allreduce import UNIT_ROUNDOFF, _contribution
from tests.support.chooser import active
from tests.support.loglines import Lines

SHAPE = (1, 2, 5)  # decode-shaped [1, b, h], 40 bytes: inside the test tables' window




def _ratio(out, members, seed):
    """max |out - exact| / ((P-1) u sum |x_q|): <= 1 for any summation order of P-1 fp32 additions."""
    xs = [_contribution(seed, q, out.numel(), torch.float32).double() for q in members]
    exact = torch.stack(xs).sum(0)
    bound = max(len(xs) - 1, 1) * UNIT_ROUNDOFF[torch.float32] * torch.stack(xs).abs().sum(0) + 1e-300
    return ((out.reshape(-1).double() - exact).abs() / bound).max().item()


def _auto(x, pg, log):
    """One auto all-reduce: (result, executor steps posted (0 = stock ran), layout log lines it emitted)."""
    ctx = OverlapContext(check_peers=True, trace=[])
    before = len(log.lines)
    out = fo.all_reduce(x, pg, algo="auto", context=ctx)
    posts = sum(e.what == "post" for e in ctx.trace)
    return out, posts, sum("node" in m for m in log.lines[before:])


def _hierarchical(x, pg):
    try:
        return fo.all_reduce(x, pg, algo="hierarchical"), ""
    except ValueError as err:
        return None, str(err)


def _case(rank, members, pg, lws, seed, log):
    os.environ["LOCAL_WORLD_SIZE"] = str(lws)
    x = _contribution(seed, rank, 10, torch.float32).view(SHAPE)
    keep = x.clone()
    out, posts, logs = _auto(x, pg, log)
    again, _, logs_again = _auto(x, pg, log)
    hier, err = _hierarchical(x, pg)
    return {"group": members, "lws": lws, "group_rank": members.index(rank), "auto": _ratio(out, members, seed),
            "same_again": bool(torch.equal(out, again)), "unchanged": bool(torch.equal(x, keep)),
            "posts": posts, "logs": logs + logs_again, "shape": tuple(out.shape),
            "hier": None if hier is None else _ratio(hier, members, seed), "hier_error": err}


def auto_on_subgroups(rank, world, groups, local_sizes, table, seed=3):
    """Every (group, LOCAL_WORLD_SIZE) case this rank belongs to; `table` is set for "auto"."""
    log = Lines(logging.WARNING)
    logging.getLogger(select.__name__).addHandler(log)
    select.warn_once.clear()  # earlier jobs in this worker may have logged the same layouts
    pgs = [dist.new_group(g) for g in groups]  # collective: every rank creates every group, in order
    try:
        with active(table=table):
            return [_case(rank, g, pg, lws, seed, log) for g, pg in zip(groups, pgs) if rank in g
                    for lws in local_sizes]
    finally:
        os.environ.pop("LOCAL_WORLD_SIZE", None)
        logging.getLogger(select.__name__).removeHandler(log)
        for pg in pgs:
            dist.destroy_process_group(pg)
