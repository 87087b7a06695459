"""Tier 1 (pure, threads only): the communication thread runs jobs in submission order, off the caller,
hands back values and exceptions, and a timed result that is not ready says so (None) instead of hanging."""
import threading

import pytest

from megatron_flashoverlap.runtime.commthread import comm_thread, threaded


def test_jobs_run_in_order_on_another_thread():
    seen, caller = [], threading.get_ident()
    pend = [comm_thread().submit(lambda k=k: seen.append((k, threading.get_ident())) or k) for k in range(50)]
    assert [p.result(10.0) for p in pend] == list(range(50))
    assert [k for k, _ in seen] == list(range(50))  # FIFO: each peer's transfers keep the program's order
    assert all(t != caller for _, t in seen)


def test_an_exception_is_raised_in_the_waiting_thread():
    def boom():
        raise RuntimeError("peer gone")
    with pytest.raises(RuntimeError, match="peer gone"):
        comm_thread().submit(boom).result(10.0)


def test_a_job_not_done_in_time_gives_none():
    gate = threading.Event()
    p = comm_thread().submit(gate.wait)
    assert p.result(0.05) is None
    gate.set()
    assert p.result(10.0) is True


def test_posts_stay_in_the_caller_under_the_profiler():
    import torch
    assert threaded()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        assert not threaded()


def test_posts_stay_in_the_caller_under_a_dispatch_mode():
    """Dispatch modes are thread-local: under one, the posts must stay where the mode can see them."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from megatron_flashoverlap.runtime.commthread import threaded

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    assert threaded()
    with Watch():
        assert not threaded()
    assert threaded()


def test_each_group_has_its_own_fifo():
    """A job holding one group's thread leaves another group's jobs free; each key keeps its own order."""
    class Group:  # any weak-referenceable key stands for a process group
        pass

    a, b, gate = Group(), Group(), threading.Event()
    assert comm_thread(a) is comm_thread(a) and comm_thread(a) is not comm_thread(b)
    held = comm_thread(a).submit(gate.wait)
    assert [comm_thread(b).submit(lambda k=k: k).result(10.0) for k in range(5)] == list(range(5))
    assert held.result(0.0) is None  # a's job is still held: b did not wait behind it
    gate.set()
    assert held.result(10.0) is True


def test_a_groups_thread_ends_with_the_group():
    import gc

    class Group:
        pass

    g = Group()
    comm_thread(g).submit(lambda: None).result(10.0)
    name = [t.name for t in threading.enumerate() if t.name == f"flashoverlap-comm-{id(g):x}"]
    assert len(name) == 1
    del g
    gc.collect()
    for _ in range(100):
        if name[0] not in [t.name for t in threading.enumerate()]:
            break
        threading.Event().wait(0.05)
    assert name[0] not in [t.name for t in threading.enumerate()]
