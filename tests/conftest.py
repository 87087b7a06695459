"""Session fixtures: one persistent gloo pool per world size (see megatron_flashoverlap/testing/pool.py)."""
import pytest

from megatron_flashoverlap.testing import Pool

_POOLS: dict = {}


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
