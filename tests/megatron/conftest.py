"""The `pretrain` fixture: Megatron pretrain() runs declared by the selected tests, one torchrun start-up per
world size for all of them (tests/support/pretrain_runs.py); `clean_config`: no config active, none named by the
environment (the spec and the layers then read the defaults)."""
from __future__ import annotations

import pytest

from tests.support.pretrain_runs import run_batch


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
    """`pretrain(name)` -> the Result of a job some selected test declared: the first read of a world size runs
    every declared job of that size not yet run, in one batch."""
    jobs, results = _declared(request.session.items), {}
    tmp = tmp_path_factory.mktemp("pretrain")

    def get(name: str):
        if name not in jobs:
            raise KeyError(f"job {name!r} is not declared: add it to the test's @pytest.mark.pretrain(...)")
        if name not in results:
            world = jobs[name].world
            batch = [j for j in jobs.values() if j.world == world and j.name not in results]
            results.update(run_batch(batch, tmp / f"batch{len(results)}-world{world}", tmp))
        return results[name]
    get.tmp = tmp  # the folder "{tmp}" names in a job's argv
    return get
