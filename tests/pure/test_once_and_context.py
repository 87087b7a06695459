"""The package's one context factory (runtime/context.shared_context) and one say-once helper (runtime/once.py).

Tier: pure (no process group: contexts are built, not used; log records are captured).
"""
from __future__ import annotations

import logging
import multiprocessing as mp
from datetime import timedelta

import pytest

from megatron_flashoverlap.runtime import default_context, shared_context
from megatron_flashoverlap.runtime.once import LogOnce, print_rank0


def test_default_context_is_one_per_process_with_per_shape_peer_checks():
    assert default_context() is default_context() is shared_context("default")
    assert default_context().check_peers == "once"


def test_layer_contexts_one_per_timeout_without_per_call_peer_check():
    a, b = shared_context("layer"), shared_context("layer", 7.5)
    assert a is shared_context("layer") and b is shared_context("layer", 7.5) and a is not b
    assert a.check_peers == b.check_peers == "never"
    assert b.timeout == timedelta(seconds=7.5) and a.timeout == default_context().timeout
    assert a is not default_context()  # the layers' buffers are not the bare operators'


def test_worker_context_is_its_own_and_keeps_its_first_timeout():
    w = shared_context("worker", 3.0)
    assert w is shared_context("worker", 9.0)  # one per process: the first caller's timeout
    assert w.timeout == timedelta(seconds=3.0) and w.check_peers == "never"
    assert w is not shared_context("layer", 3.0) and w is not default_context()


def _worker_in_child(q):
    q.put(shared_context("worker", 1.0).timeout.total_seconds())


def test_a_forked_process_gets_a_worker_context_of_its_own():
    shared_context("worker", 3.0)
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_worker_in_child, args=(q,))
    p.start()
    got = q.get(timeout=60)
    p.join(60)
    assert got == 1.0  # not the parent's (timeout 3.0): a fork does not inherit the worker thread


def test_unknown_use_names_the_choices():
    with pytest.raises(ValueError, match="default.*layer.*worker"):
        shared_context("decode")


def test_log_once_says_each_key_once_at_its_level_from_the_callers_line(caplog):
    log = logging.getLogger("flashoverlap.test_once")
    said = LogOnce(log, logging.INFO)
    with caplog.at_level(logging.INFO, logger=log.name):
        assert said(("k", 1), "%s: stock (%s)", "Linear", "why") is True
        assert said(("k", 1), "%s: stock (%s)", "Linear", "other words") is False
        said("k2", "100% plain, no args")
    assert [r.getMessage() for r in caplog.records] == ["Linear: stock (why)", "100% plain, no args"]
    assert {r.levelno for r in caplog.records} == {logging.INFO}
    assert caplog.records[0].filename == "test_once_and_context.py"  # the caller, not runtime/once.py
    said.clear()  # tests reset it between runs in one process
    assert said(("k", 1), "again") is True


def test_log_once_to_a_callable_with_the_key_as_the_line():
    lines = []
    said = LogOnce(lines.append)
    said("> --flash-overlap: on")
    said("> --flash-overlap: on")
    said("n=%d", "n=%d", 3)
    assert lines == ["> --flash-overlap: on", "n=3"]


def test_print_rank0_prints_on_rank_0_only(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    print_rank0("hidden")
    monkeypatch.setenv("RANK", "0")
    print_rank0("shown")
    monkeypatch.delenv("RANK")
    print_rank0("unset is rank 0")
    assert capsys.readouterr().out == "shown\nunset is rank 0\n"
