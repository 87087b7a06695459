"""The `pretrain` fixture: Megatron pretrain() runs declared by the selected tests, one torchrun start-up per
world size (two for a world of many jobs), all started side by side (tests/support/pretrain_runs.py);
`clean_config`: no config active, none named by the environment (the spec and the layers then read the defaults)."""
from __future__ import annotations

import concurrent.futures

import pytest

from tests.support.pretrain_runs import batches, run_batch


@pytest.fixture
def clean_config(monkeypatch):
    from megatron_flashoverlap import config as fc

    monkeypatch.delenv("FLASHOVERLAP_CONFIG", raising=False)
    monkeypatch.delenv("FLASHOVERLAP_QUERY_SPLIT", raising=False)
    previous = fc.activate(None)
    yield fc
    fc.activate(previous)


def pytest_configure(config):
    config.addinivalue_line("markers", "pretrain(*jobs): the pretrain() runs (tests.support.pretrain_runs.Job) "
                                       "this test reads through the `pretrain` fixture")


def _declared(items) -> dict:
    jobs: dict = {}
    for item in items:
        for mark in item.iter_markers("pretrain"):
            for job in mark.args:
                assert jobs.setdefault(job.name, job) == job, f"two different jobs named {job.name}"
    return jobs


@pytest.fixture(scope="session")
def pretrain(request, tmp_path_factory):
    """`pretrain(name)` -> the Result of a job some selected test declared: the first read starts every declared
    job, in the batches of pretrain_runs.batches side by side; a read waits for its job's batch."""
    jobs, started = _declared(request.session.items), {}
    tmp = tmp_path_factory.mktemp("pretrain")
    runner = concurrent.futures.ThreadPoolExecutor(max_workers=8)

    def get(name: str):
        if name not in jobs:
            raise KeyError(f"job {name!r} is not declared: add it to the test's @pytest.mark.pretrain(...)")
        if not started:
            for i, batch in enumerate(batches(list(jobs.values()))):
                done = runner.submit(run_batch, batch, tmp / f"batch{i}-world{batch[0].world}", tmp)
                started.update({j.name: done for j in batch})
        return started[name].result()[name]
    get.tmp = tmp  # the folder "{tmp}" names in a job's argv
    yield get
    runner.shutdown(wait=True)
