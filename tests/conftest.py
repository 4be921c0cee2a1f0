import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for p in (ROOT, os.path.join(ROOT, "examples")):
    if p not in sys.path:
        sys.path.insert(0, p)

from tests.dist_pool import start  # noqa: E402

_pools: dict = {}


def get_pool(world: int):
    """One live pool per world size; a pool broken by a failed check is replaced."""
    pool = _pools.get(world)
    if pool is None or pool.broken:
        for other in list(_pools):  # keep one pool at a time: 2 cores, 4-9 ranks
            _pools.pop(other).close()
        pool = _pools[world] = start(world)
    return pool


@pytest.fixture
def pool4():
    return get_pool(4)


@pytest.fixture
def pool9():
    return get_pool(9)


def pytest_sessionfinish(session, exitstatus):
    for pool in _pools.values():
        pool.close()
