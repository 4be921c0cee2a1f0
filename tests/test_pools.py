"""The session's pools of ranks (tests/conftest.py): which pools stay up when a test asks for another
world size. Fake pools only: nothing is spawned."""

import time

import pytest

from tests import conftest, dist_pool


class _FakePool:
    def __init__(self, world):
        self.world, self.broken = world, False

    def close(self):
        self.broken = True


def test_pools_kept_within_the_rank_budget(monkeypatch):
    """Catches a pool restarted at every switch between world sizes (8-20 s each on 2 cores), more
    idle ranks than MAX_IDLE_RANKS, and the 4-rank pool most tests use closed to make room for a
    pool that another closing would have fitted."""
    started = []

    def start(world):
        started.append(world)
        return _FakePool(world)

    monkeypatch.setattr(conftest, "_pools", {})
    monkeypatch.setattr(conftest, "start", start)
    monkeypatch.setattr(conftest, "_starts", [])  # the run's own record of pool starts keeps only real ones
    # test_uneven's order, then test_comm's, test_training's and a broken 4-rank pool
    for world in [4, 4, 9, 6, 6, 6, 4, 9, 9, 4, 6, 6, 4, 4, 9, 4, 2, 2, 4, 6, 4, 1, 8, 4]:
        pool = conftest.get_pool(world)
        assert pool.world == world and not pool.broken
        assert sum(conftest._pools) <= conftest.MAX_IDLE_RANKS, conftest._pools
    assert started == [4, 9, 6, 9, 6, 9, 2, 6, 1, 8], started
    conftest._pools[4].close()  # a check failed on a rank: the next test gets a fresh pool
    assert conftest.get_pool(4) is not pool and started[-1] == 4


def hang_on_rank_1(rank):
    """A check that never returns on rank 1 (waits as a rank stuck in a collective would)."""
    if rank == 1:
        time.sleep(120)
    return rank


def test_a_hang_says_where_every_rank_was():
    """Catches a hung multi-rank test that fails with 'no answer' and nothing more: the failure must
    show each live rank's stack (faulthandler), so the rank stuck in a collective is found at once."""
    pool = dist_pool.start(2)
    try:
        with pytest.raises(AssertionError) as e:
            pool.run(hang_on_rank_1, timeout=4)
    finally:
        pool.close(force=True)
    msg = str(e.value)
    assert "no answer within 4 s" in msg, msg
    assert "rank 0 was at" in msg and "rank 1 was at" in msg, msg
    rank1 = msg.split("rank 1 was at", 1)[1]
    assert "hang_on_rank_1" in rank1.split("rank 0 was at")[0], msg


def fresh_hang_on_rank_1(rank, world, port):
    """A process of spawn_fresh that never exits on rank 1 (no group needed to show it)."""
    if rank == 1:
        time.sleep(120)


def test_a_hung_fresh_process_says_where_it_was():
    """Catches a check on fresh processes (a killed rank, a broken group) that hangs and fails with
    'a rank hung' and nothing more: join must name the rank still running and show its stack, and
    leave no process behind."""
    procs = dist_pool.spawn_fresh(fresh_hang_on_rank_1, 2)
    msg = procs.join(timeout=6)
    assert msg.startswith("rank(s) [1] still running after 6 s"), msg
    assert "rank 1 was at" in msg and "fresh_hang_on_rank_1" in msg and "rank 0 was at" not in msg, msg
    assert not any(p.is_alive() for p in procs), "join left a process running"
