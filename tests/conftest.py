import json
import os
import shutil
import sys
import tempfile
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for p in (ROOT, os.path.join(ROOT, "examples")):
    if p not in sys.path:
        sys.path.insert(0, p)

from tests.dist_pool import start  # noqa: E402
from tests.slow_tier import SLOW  # noqa: E402

# Inductor's on-disk caches (compiled C++ kernels) in a directory of this session's own, set before any
# pool rank is spawned so that every rank inherits it: the ranks and the tests share the kernels one of
# them compiled, and a cache left warm by an earlier run cannot make the suite look faster than a clean
# CI checkout runs it. A directory the caller chose is kept (and used).
_OWN_CACHE = "TORCHINDUCTOR_CACHE_DIR" not in os.environ
if _OWN_CACHE:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="autopar-tests-inductor-")

# Inductor picks the CPU's vector ISA by dry-compiling a probe program per ISA the CPU's flags list and
# loading it in a child process: 7 s per process here, paid again by every rank that compiles (ranks
# 1-3 wait on rank 0's lock). The suite trusts the flags instead (torch's own switch for this), so the
# kernels are the ones the probe would pick (the first ISA the flags allow); a compiler that cannot
# build for it fails the compiled tests instead of falling back quietly. A value the caller set is kept.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "1")

# A rank whose collective fails waits up to AUTOPAR_FLIGHT_WAIT s for its peers' hang reports
# (`passes.ops.flight`); the checks that kill or freeze a rank on purpose would each wait out its 5 s for the
# silent one. 1 s here; the test of the diagnosis itself sets 5.
os.environ.setdefault("AUTOPAR_FLIGHT_WAIT", "1")

_pools: dict = {}  # world -> live pool, least recently used first
_starts: list = []  # (world, seconds) of every pool started, printed after a whole run
# Idle ranks cost memory (~0.4 GB each), not CPU: the 4-rank pool most tests use stays up while a
# file alternates it with a 6- or 9-rank grid, instead of paying a fresh start (8-20 s) per switch.
MAX_IDLE_RANKS = 13


def get_pool(world: int):
    """One live pool per world size, at most MAX_IDLE_RANKS ranks in all; a pool broken by a failed
    check is replaced. To make room, the least recently used pool whose closing alone suffices closes
    (4 + 6 ranks then 9: the 6 closes), else the least recently used; the 4-rank pool, which most tests
    use, closes last."""
    pool = _pools.pop(world, None)
    if pool is None or pool.broken:
        while _pools and sum(_pools) + world > MAX_IDLE_RANKS:
            order = sorted(_pools, key=lambda w: w == 4)  # stable: least recently used first otherwise
            enough = [w for w in order if sum(_pools) - w + world <= MAX_IDLE_RANKS]
            _pools.pop((enough or order)[0]).close()
        began = time.monotonic()
        pool = start(world)
        _starts.append((world, time.monotonic() - began))
    _pools[world] = pool  # re-inserted: now the most recently used
    return pool


@pytest.fixture
def pool4():
    return get_pool(4)


@pytest.fixture
def pool9():
    return get_pool(9)


def _run_slow() -> bool:
    """RUN_SLOW=1 (`make test-all`): the slow tier runs too."""
    return os.environ.get("RUN_SLOW", "0") not in ("", "0")


def pytest_collection_modifyitems(config, items):
    """The slow tier (`@pytest.mark.slow`) runs only with RUN_SLOW=1 (`make test-all`), as
    transformers' slow tests do; `make test` deselects it, and says how many it left out. The cases
    tests/slow_tier.py lists are marked here; one it names that a collected file lacks stops the run."""
    ids = {item.nodeid for item in items}
    files = {i.split("::")[0] for i in ids}
    whole_files = not any("::" in a for a in config.args) and not config.option.keyword
    stale = [k for k in SLOW if whole_files and k.split("::")[0] in files and k not in ids]
    if stale:
        raise pytest.UsageError(f"tests/slow_tier.py names tests that do not exist (renamed?): {stale}")
    for item in items:
        if item.nodeid in SLOW:
            item.add_marker(pytest.mark.slow)
    if _run_slow():
        return
    slow = [item for item in items if item.get_closest_marker("slow")]
    if slow:
        items[:] = [item for item in items if not item.get_closest_marker("slow")]
        config.hook.pytest_deselected(items=slow)


def pytest_report_header(config):
    return ("slow tier: run (RUN_SLOW=1)" if _run_slow()
            else "slow tier: deselected (make test-all or RUN_SLOW=1 runs it)")


FAST_TIER_BUDGET_S = 12 * 60  # `make test` on a quiet 2-core machine (README, Contributing)
_started = time.monotonic()
_per_file: dict = {}  # test file -> seconds of setup, call and teardown of its tests


_per_test: dict = {}  # test id -> seconds, written to $AUTOPAR_TEST_TIMES (JSON) where it is set


def pytest_runtest_logreport(report):
    path = report.nodeid.split("::", 1)[0]
    _per_file[path] = _per_file.get(path, 0.0) + report.duration
    _per_test[report.nodeid] = _per_test.get(report.nodeid, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """After a run of the whole fast tier, its time against the budget: printed, never asserted
    (machines are noisy), so the change that grows the suite past it is seen in its own log."""
    whole = config.args == config.getini("testpaths") and not (config.option.collectonly or config.option.keyword)
    if _run_slow() or not whole:
        return
    took = time.monotonic() - _started
    ranked = sorted(_per_file.items(), key=lambda kv: -kv[1])
    terminalreporter.write_line("seconds per file: " + ", ".join(f"{os.path.basename(p)} {t:.0f}" for p, t in ranked
                                                                   if t >= 1))
    workers = getattr(config.option, "numprocesses", None)
    if workers:  # pytest-xdist: the pools live in the workers, and the files' seconds overlap
        terminalreporter.write_line(f"({workers} pytest workers: seconds per file side by side; pools in the workers)")
    else:
        terminalreporter.write_line(f"pools started: {len(_starts)} ({sum(s for _, s in _starts):.0f} s; worlds "
                                    + ", ".join(str(w) for w, _ in _starts) + ")")
    word = "within" if took <= FAST_TIER_BUDGET_S else "OVER"
    terminalreporter.write_line(
        f"fast tier: {took:.0f} s, {word} its {FAST_TIER_BUDGET_S // 60}-minute budget on a quiet 2-core machine "
        f"(a test that repeats a covered path on another grid, family or option goes to tests/slow_tier.py)")


def pytest_sessionfinish(session, exitstatus):
    if os.environ.get("AUTOPAR_TEST_TIMES"):
        with open(os.environ["AUTOPAR_TEST_TIMES"], "w") as f:
            json.dump(dict(sorted(_per_test.items(), key=lambda kv: -kv[1])), f, indent=1)
    for pool in _pools.values():
        pool.close()
    if _OWN_CACHE:
        shutil.rmtree(os.environ["TORCHINDUCTOR_CACHE_DIR"], ignore_errors=True)
