"""Rank bodies for tests/gloo/test_bench.py (run on the gloo pool, or started by harness.launch.run_ranks)."""
import os
import sys
import threading
import time

import torch
import torch.distributed as dist

from benchmarks.overlap import worker
from benchmarks.harness.blocks import METHODS, Shape, make_block, operator_methods
from megatron_flashoverlap.runtime import OverlapContext


def harness(rank, world, cfg):
    """The worker's whole run (probes, interleaved repeats, trace) on tiny sizes; rank 0 returns the output."""
    return worker.run(cfg)


def block_outputs(rank, world, kind, shape_args):
    """Forward + backward of one block under every method: {method: (y, dx, dw_in, dw_out)} on this rank."""
    out = {}
    for m in operator_methods(METHODS):
        blk = make_block(kind, Shape(*shape_args), world, seed=3)
        x = blk.input(seed=4).requires_grad_()
        y = blk.forward(x, None, m, OverlapContext(check_peers=True))
        y.backward(torch.ones_like(y))
        out[m.name] = (y.detach(), x.grad, blk.w_in.grad, blk.w_out.grad)
    return out


def ranks_echo(rank, world, payload):
    """run_ranks function target: who I am, the payload back, my own env tag, and a sum over the group."""
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    return {"rank": rank, "world": world, "payload": payload, "tag": os.environ.get("BENCH_TEST_TAG"),
            "common": os.environ.get("BENCH_TEST_COMMON"), "sum": t.item()}


def ranks_fail(rank, world):
    """Rank 1 raises; rank 0 waits in a barrier that never completes unless the launcher stops it."""
    if rank == 1:
        raise ValueError("rank 1 fails on purpose")
    dist.barrier()


def ranks_abort(rank, world):
    """Rank 1 starts a thread that waits in `_parked_beside_the_abort`, then aborts the process (SIGABRT, as
    std::terminate does); rank 0 waits in a barrier that never completes unless the launcher stops it."""
    if rank == 1:
        started = threading.Event()
        threading.Thread(target=_parked_beside_the_abort, args=(started,), daemon=True).start()
        started.wait(10)
        os.abort()
    dist.barrier()


def _parked_beside_the_abort(started):
    started.set()
    threading.Event().wait()


def ranks_sleep(rank, world, pid_dir):
    """Writes this rank's pid, then sleeps far past any test timeout."""
    with open(os.path.join(pid_dir, f"{rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(600)


if __name__ == "__main__":  # run_ranks module target: hand argv and the rank back through save_result
    from benchmarks.harness.launch import save_result

    if os.environ["RANK"] == "0":
        save_result({"argv": sys.argv[1:], "rank": int(os.environ["RANK"])})
