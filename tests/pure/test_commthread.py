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


def test_an_idle_thread_holds_no_job():
    """Once a job has run, its closure (the tensors a post captured) is freed at once, not when the next job
    arrives: an idle thread freeing tensors at interpreter finalization aborts the process
    (runtime/commthread.py)."""
    import gc
    import weakref

    class Box:  # stands for the tensors a post's closure captures
        pass

    box = Box()
    alive = weakref.ref(box)
    comm_thread().submit(lambda b=box: b is not None).result(10.0)
    del box
    for _ in range(100):
        gc.collect()
        if alive() is None:
            break
        threading.Event().wait(0.02)
    assert alive() is None, "the communication thread still holds its last job after running it"


def test_threads_are_joined_before_the_interpreter_finalizes(tmp_path):
    """A job still running when the main thread ends completes before finalization (the atexit hook joins the
    threads); a daemon thread left to finalization would be killed mid-job (or abort the process)."""
    import os
    import subprocess
    import sys

    done = tmp_path / "done"
    script = ("import threading, time\n"
              "from megatron_flashoverlap.runtime.commthread import comm_thread\n"
              "class Group: pass\n"
              "g = Group()\n"
              f"comm_thread(g).submit(lambda: (time.sleep(1.0), open({str(done)!r}, 'w').write('ok')))\n")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert done.exists() and done.read_text() == "ok", "the job was cut off at exit: the thread was not joined"
