"""Worker-side bodies of the transport tests (run on every rank by the gloo pool): the transport each
group gets, dead peers at post and at wait time, the steady state's traffic, the buffer cap."""
from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist

import megatron_flashoverlap as fo
from benchmarks.harness.timing import fake_group
from megatron_flashoverlap.runtime import PeerLostError, default_context, first_peer_error, link
from tests.support.profile import comm_ops


def kinds(rank, world):
    """The transport of the gloo world and of a fake group; an operator walks on the fake group."""
    fake = fake_group(world)
    y = fo.all_gather_matmul(torch.randn(2, 1, 4), torch.randn(3, 4), fake, context=fo.OverlapContext(check_peers="never"))
    return {"gloo": link(None, torch.device("cpu")).kind, "fake": link(fake, torch.device("cpu")).kind,
            "fake_shape": tuple(y.shape)}


def _attempt(fn, stock: bool = False) -> dict:
    """fn() -> its kind of failure ("timeout", "lost"; stock: gloo's own RuntimeError, "stock"), message, seconds."""
    t0 = time.monotonic()
    try:
        fn()
    except fo.PeerTimeoutError as e:
        return {"kind": "timeout", "message": str(e), "seconds": time.monotonic() - t0}
    except PeerLostError as e:
        return {"kind": "lost", "message": str(e), "seconds": time.monotonic() - t0}
    except RuntimeError as e:
        if not stock:
            raise
        return {"kind": "stock", "message": str(e), "seconds": time.monotonic() - t0}
    return {"kind": None, "message": None, "seconds": time.monotonic() - t0}


def _ag(group, algo="flash", timeout_s=2.0):
    ctx = fo.OverlapContext(timeout=None if timeout_s is None else timedelta(seconds=timeout_s), check_peers="never")
    plan = fo.OpPlan(algo, num_chunks=2 if algo == "slicing" else None)
    return lambda: fo.all_gather_matmul(torch.randn(4, 2, 8), torch.randn(6, 8), group, plan=plan, context=ctx)


def _deferred_rs(group, timeout_s=2.0):
    """The DP ring with its last hop deferred: the call returns (its posts need no peer), finish() waits."""
    ctx = fo.OverlapContext(timeout=timedelta(seconds=timeout_s), check_peers="never")

    def run():
        finish = fo.matmul_wgrad_reduce_scatter(torch.randn(3, 2, 4), torch.randn(3, 2, 4),
                                                fo.DPBucket(torch.zeros(16), 0), group, context=ctx, defer_last=True)
        finish()
    return run


def dead_peers(rank, world):
    """Rank 1 leaves or skips; rank 0 reports what it saw. Each case runs on its own fresh subgroup, so a
    broken group never touches the next case; the default group only orders the cases."""
    out = {}
    for case in ("post", "wait", "timeout", "slicing_timeout", "deferred_timeout"):
        sub = dist.new_group([0, 1])
        dist.barrier()
        if rank == 1:
            if case in ("post", "wait"):
                time.sleep(0.0 if case == "post" else 1.0)  # "wait": rank 0 is waiting on its transfers by now
                dist.destroy_process_group(sub)
                del sub  # the last reference: the group's connections close (rank 1 "left")
            dist.barrier()
            continue
        if case == "post":
            time.sleep(1.0)  # the closed connection reaches rank 0 before it posts
        out[case] = _attempt(_deferred_rs(sub) if case == "deferred_timeout" else
                             _ag(sub, "slicing" if case == "slicing_timeout" else "flash"))
        dist.barrier()
    if rank == 0:
        out["first"] = str(first_peer_error())  # what an entry's error of another kind is noted with
    return out


GROUP_TIMEOUT_S = 3.0


def _stock_ag(group):
    x = torch.randn(4, 2, 8)
    return lambda: dist.all_gather_into_tensor(torch.empty(8, 2, 8), x, group=group)


def group_timeouts(rank, world):
    """Rank 1 skips each call; rank 0 reports when it gave up. Each case on its own fresh subgroup made with a
    GROUP_TIMEOUT_S timeout: stock's all-gather, ours with no bound of its own (the group's timeout alone),
    ours with a larger bound (60 s: the group's is smaller and wins), ours with a smaller bound (1 s wins)."""
    out = {}
    for case, bound in (("stock", None), ("ours", None), ("ours_larger_bound", 60.0), ("ours_smaller_bound", 1.0)):
        sub = dist.new_group([0, 1], timeout=timedelta(seconds=GROUP_TIMEOUT_S), group_desc=f"CASE_{case.upper()}")
        if rank == 0:  # stock: gloo's own "Timed out waiting ..."
            out[case] = _attempt(_stock_ag(sub), stock=True) if case == "stock" else _attempt(_ag(sub, timeout_s=bound))
        dist.barrier()
    return out


def _ops_on(t, ctx=None):
    """One call of every public operator with default arguments (and backward where it has one)."""
    kw = {} if ctx is None else {"context": ctx}
    world = dist.get_world_size()
    x_s, w = t(2, 2, 8), t(6, 8)
    xf, wr = t(2 * world, 2, 6), t(8, 6)
    q = t(2 * world, 2, 2, 4)
    q_s = t(2, 2, 2 * world, 4)
    grads = [
        fo.all_gather_matmul(x_s, w, bias=t(6), **kw),
        fo.matmul_reduce_scatter(xf, wr, **kw),
        fo.matmul_all_reduce(xf, wr, **kw),
        fo.matmul_allreduce_dgrad(t(2 * world, 2, 8), w, bias=t(6), **kw),
        fo.query_split_attention(q, q, q, t(5, 8), **kw),
        fo.ulysses_attention(q_s, q_s, q_s, **kw),
        fo.ulysses_fused_attention(x_s, t(3 * 2 * world * 4, 8), t(5, 2 * world * 4),
                                   attend=fo.Attend(heads=2 * world), **kw),
    ]
    sum(g.sum() for g in grads).backward()
    fo.all_reduce(t(16), algo="ring", **kw)
    fo.all_reduce(t(16), **kw)  # "auto" without a calibration table: the stock all-reduce, its own traffic
    dy = t(2 * world, 2, 4)
    fo.matmul_wgrad_reduce_scatter(dy, t(2 * world, 2, 3), fo.DPBucket(torch.zeros(world * 12), 0), None, **kw)


def steady_state_traffic(rank, world):
    """c10d ops of the first and the second call of every operator (default context; then the same with
    check_peers="always" and "never" on their own contexts)."""
    g = torch.Generator().manual_seed(0)

    def t(*shape):
        return torch.randn(*shape, generator=g).requires_grad_()
    default_context().forget_peer_checks()  # every rank at once: earlier jobs may have checked these shapes
    out = {"first": comm_ops(lambda: _ops_on(t)), "second": comm_ops(lambda: _ops_on(t))}
    always, never = fo.OverlapContext(check_peers="always"), fo.OverlapContext(check_peers="never")
    _ops_on(t, always)
    out["always_second"] = comm_ops(lambda: _ops_on(t, always))
    out["never_first"] = comm_ops(lambda: _ops_on(t, never))
    return out


def buffer_cap(rank, world, lengths, b, h, n):
    """all_gather_matmul and matmul_reduce_scatter, forward + backward, over many sequence lengths on one
    context. -> bytes the context holds after the sweep and one shard's bytes at the largest length."""
    ctx = fo.OverlapContext()
    g = torch.Generator().manual_seed(rank)
    w_col, w_row = torch.randn(n, h, generator=g).requires_grad_(), torch.randn(h, n, generator=g).requires_grad_()
    for s in lengths:  # s: the global sequence length, a multiple of the group size
        x = torch.randn(s // world, b, h, generator=g).requires_grad_()
        y = fo.all_gather_matmul(x, w_col, context=ctx)  # [s, b, n]
        z = fo.matmul_reduce_scatter(y, w_row, context=ctx)  # [s/P, b, h]
        z.sum().backward()
    return {"held": ctx.held_bytes(), "shard": max(lengths) // world * b * max(h, n) * 4}


def posted_off_thread(rank, world):
    """One ring hop through the gloo link: posted on the communication thread (a Pending comes back at once),
    then waited on; -> whether it was deferred and whether the received tensor is the peer's."""
    from megatron_flashoverlap.runtime.commthread import Pending

    lk, nxt, prv = link(None, torch.device("cpu")), (rank + 1) % world, (rank - 1) % world
    send, recv = torch.full((1024,), float(rank)), torch.empty(1024)
    works = lk.post(0, [send], [nxt], [recv], [prv])
    deferred = isinstance(works, Pending)
    lk.wait(works, "step 0", [("send", nxt), ("receive", prv)], default_context().timeout)
    return {"deferred": deferred, "received": bool(torch.all(recv == float(prv)))}


def _ring(lk, rank, world, steps, base, timeout) -> bool:
    """`steps` ring hops on one link (value base + 100 * step + rank) -> whether every hop brought prev's."""
    nxt, prv, ok = (rank + 1) % world, (rank - 1) % world, True
    for step in range(steps):
        send, recv = torch.full((4096,), float(base + 100 * step + rank)), torch.empty(4096)
        lk.wait(lk.post(step, [send], [nxt], [recv], [prv]), f"step {step}", [("send", nxt), ("receive", prv)],
                timeout)
        ok = ok and bool(torch.all(recv == float(base + 100 * step + prv)))
    return ok


def two_groups(rank, world):
    """Two groups over the same ranks. stuck: group A's thread is held by a job that does not return (as a
    post that blocks on its peer would); a hop on group B must still complete. concurrent: a ring on each
    group from two threads at once (the TP rings of backward beside the DP worker's rings)."""
    import threading

    from megatron_flashoverlap.runtime.commthread import comm_thread

    ga, gb = dist.new_group(list(range(world))), dist.new_group(list(range(world)))
    la, lb = link(ga, torch.device("cpu")), link(gb, torch.device("cpu"))
    timeout, gate = timedelta(seconds=10), threading.Event()
    held = comm_thread(ga).submit(gate.wait)
    try:
        stuck = _attempt(lambda: _ring(lb, rank, world, 1, 0, timeout))
    finally:
        gate.set()
    held.result(10.0)
    out = {}
    threads = [threading.Thread(target=lambda k=k, lk=lk: out.__setitem__(k, _ring(lk, rank, world, 30, k, timeout)))
               for k, lk in ((1000, la), (2000, lb))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60.0)
    dist.barrier()
    return {"stuck": stuck, "concurrent": out, "threads": [comm_thread(g) is not comm_thread(None) for g in (ga, gb)]}
