"""Session fixtures and tiers.

Tiers are folders, cheapest first; each test is marked by its folder (`-m pure`, `-m gloo`, ...):
    tests/pure/      schedules, config, import layering: no processes, seconds
    tests/gloo/      operators and the benchmark harness on 2-8 gloo CPU processes
    tests/megatron/  Megatron-Core layers, models, launcher and training loop on gloo
    tests/gpu/       CUDA only: skipped, with the reason, where no GPU is present
One persistent gloo pool per world size (see tests/support/pool.py).
"""
import os
import pathlib

import pytest

from tests.support import Pool

TIERS = ("pure", "gloo", "megatron", "gpu")
_ROOT = pathlib.Path(__file__).parent
_POOLS: dict = {}


def pytest_addoption(parser):
    parser.addoption("--mutation", default=None, help="run under a deliberate defect of tests/support/mutations.py "
                     "(in this process and in every gloo worker); `python -m tests.support.mutations --list`")


def pytest_configure(config):
    name = config.getoption("--mutation")
    if name:
        from tests.support import mutations

        os.environ[mutations.ENV] = name  # the pool's workers inherit it and apply it at start
        mutations.MUTATIONS[name].apply()


def pytest_collection_modifyitems(config, items):
    for item in items:
        rel = pathlib.Path(str(item.fspath)).resolve().relative_to(_ROOT.resolve())
        tier = rel.parts[0] if len(rel.parts) > 1 else None
        if tier not in TIERS:
            raise pytest.UsageError(f"{rel}: every test lives in a tier folder {TIERS}")
        item.add_marker(getattr(pytest.mark, tier))


@pytest.fixture(scope="session")
def pools():
    """`pools(world_size)` -> the session's Pool of that size, started on first use."""
    def get(world_size: int) -> Pool:
        if world_size not in _POOLS:
            _POOLS[world_size] = Pool(world_size)
        return _POOLS[world_size]
    yield get
    for p in _POOLS.values():
        p.close()
