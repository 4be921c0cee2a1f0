"""Simulated ranks side by side: `autopar.dry_run` runs its ranks in several forked processes at once.

A dry run simulates ranks one after another, and on fake tensors each rank's step costs seconds of one
CPU core (the fake tensors' dispatch, not the model's size, sets it). The ranks are independent but for
what they send one another as objects while `parallelize` sets them up: rank 0's decisions (its
strategy choice, its arrangement) and a pipeline stage's layouts for the next stage (`Recorder`). So
`side_by_side` forks workers, gives each every n-th rank in order (rank 0 to this process), and lets them
share those objects through a `Relay`: a rank that receives an object whose sender is simulated by
another worker, at a lower rank, waits until the sender has put it or has finished its setup. A rank
only waits on lower ranks, and every worker runs its ranks in increasing order, so the lowest rank
whose setup is unfinished never waits: no worker waits for ever. What each rank receives is what it
would receive simulated one after another (objects put by the setups of the lower ranks); objects a
step puts (fake tensors, whose values are meaningless) stay in their worker. A looped pipeline schedule
builds a rank's later stage from what a later rank sends it: there every rank gets a worker of its own
and waits, whatever the order, for the simulated ranks that stand in for the sender (`stand_in`); it
waits only where the real program would, so no more for ever than the program itself.

Forking needs the platform's `fork` (Linux); elsewhere, or with one worker, the ranks run in this
process one after another.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import queue
import sys
import traceback

import torch

from autopar.errors import AutoparError
from passes.compat import is_fake

__all__ = ["Relay", "WorkerError", "can_fork", "side_by_side"]

_POLL_S = 1.0  # how often a waiting worker looks whether the workers it waits for still live


class WorkerError(AutoparError, RuntimeError):
    """A worker process of a dry run failed or died; its message carries the worker's traceback."""


def can_fork() -> bool:
    """Linux's fork (elsewhere a forked process that runs torch may crash: macOS's libraries refuse it)."""
    return sys.platform.startswith("linux") and "fork" in multiprocessing.get_all_start_methods()


class Relay:
    """What simulated ranks send one another as objects, by channel and position (`Recorder`). In one
    process a dictionary; between forked workers (`side_by_side`) each object a setup puts is also sent
    to the other workers, and `get` waits for an object whose sender runs in another worker."""

    def __init__(self, owner: dict | None = None, me: int = 0, boxes: list | None = None, stand_in=None):
        self.entries: dict = {}
        # any order (`side_by_side(..., stand_in=)`): source rank -> the simulated ranks an object from it may
        # come from, whatever their order; else an object comes from a lower rank only
        self.stand_in = stand_in
        self.owner = owner or {}  # simulated rank -> the worker that simulates it (empty: one process)
        self.me, self.boxes = me, boxes or []
        self.ready: set = set()  # ranks whose setup has finished, in any worker
        self.results: dict = {}  # the parent's: rank -> what a child worker's rank returned

    def put(self, key, t: torch.Tensor, alt, rank: int) -> None:
        """Keep `t` (a copy), which `rank` sends, as the object on channel position `key` (and on `alt`, if
        nothing is there)."""
        t = t.detach().clone()
        self.entries[key] = t
        if alt is not None:
            self.entries.setdefault(alt, t)
        if self.boxes and not is_fake(t):
            blob = (str(t.dtype).removeprefix("torch."), tuple(t.shape), t.contiguous().numpy().tobytes())
            self._tell(("entry", key, alt, blob), rank)

    def get(self, key, alt, source: int, rank: int):
        """The object at `key` (else at `alt`), put by `source` for `rank`; None if no simulated rank
        below `rank` puts it. Waits where the sender is simulated by another worker and not set up yet."""
        while True:
            got = self.entries.get(key, self.entries.get(alt) if alt is not None else None)
            if got is not None or not self._waits(source, rank):
                return got
            self.receive(block=True)

    def setup_done(self, rank: int) -> None:
        self.ready.add(rank)
        if self.boxes:
            self._tell(("ready", rank), rank)

    def _waits(self, source: int, rank: int) -> bool:
        """Whether an object for `rank` may still come: from `source` if it is simulated, else from any
        simulated rank below `rank` (the channel between stages takes any rank of the sending stage)."""
        if self.stand_in is not None:
            waited = [source] if source in self.owner else self.stand_in(source)
            return any(r not in self.ready and r != rank for r in waited)
        waited = [source] if source in self.owner else list(self.owner)
        return any(r < rank and r not in self.ready and self.owner[r] != self.me for r in waited)

    def _tell(self, message, rank: int) -> None:
        """`message` to each other worker that has a rank above `rank` to simulate (one that has ended
        reads nothing more, and what it leaves unread would hold this worker at its exit)."""
        later = {w for r, w in self.owner.items() if r > rank or self.stand_in is not None}
        for w, box in enumerate(self.boxes):
            if w != self.me and w in later:
                box.put(message)

    def receive(self, block: bool) -> bool:
        """Take one message from this worker's box (waiting for it if `block`) into the relay; whether
        there was one."""
        while True:
            try:
                message = self.boxes[self.me].get(timeout=_POLL_S) if block else self.boxes[self.me].get_nowait()
                break
            except queue.Empty:
                if not block:
                    return False
                _check_alive(self.me)
        kind = message[0]
        if kind == "entry":
            _, key, alt, (dtype, shape, data) = message
            t = torch.frombuffer(bytearray(data), dtype=getattr(torch, dtype)).reshape(shape) if data else \
                torch.empty(shape, dtype=getattr(torch, dtype))
            self.entries[key] = t
            if alt is not None:
                self.entries.setdefault(alt, t)
        elif kind == "ready":
            self.ready.add(message[1])
        elif kind == "run":
            self.results[message[1]] = message[2]
        else:  # "error": a child worker failed; its own exception where it could be sent, else its traceback
            _, rank, text, error = message
            if error is None:
                raise WorkerError(f"autopar.dry_run: the worker simulating rank {rank} failed:\n{text}")
            error.add_note(f"(raised in the worker process simulating rank {rank}:\n{text})")
            raise error
        return True


_CHILDREN: list = []  # the parent's live worker processes (checked while it waits)
_PARENT: list = []  # a child's parent pid


def _check_alive(me: int) -> None:
    if me:
        if os.getppid() != _PARENT[0]:
            os._exit(1)  # the dry run that forked this worker is gone
        return
    dead = [p for p in _CHILDREN if not p.is_alive() and p.exitcode]
    if dead:
        raise WorkerError(f"autopar.dry_run: a worker process died (exit code {dead[0].exitcode}); run with "
                          f"workers=1 to simulate the ranks in this process and see the error")


def side_by_side(ranks: list, workers: int, simulate, done=None, stand_in=None) -> dict:
    """{rank: simulate(rank, relay)} for `ranks` (sorted, rank 0 first), run by `workers` processes: this
    one and workers - 1 forked ones, worker w taking ranks[w::workers]. `simulate` must call
    `relay.setup_done(rank)` once the rank's setup is over; `done(rank)` is called here as each rank ends.
    `stand_in(source)`: the simulated ranks that send what `source` would, for ranks whose setups wait on
    higher ranks (a looped pipeline schedule): each rank then needs a worker of its own."""
    workers = max(1, min(workers, len(ranks))) if can_fork() else 1
    if workers == 1:
        relay, out = Relay(), {}
        for rank in ranks:
            out[rank] = simulate(rank, relay)
            if done:
                done(rank)
        return out
    ctx = multiprocessing.get_context("fork")
    owner = {r: i % workers for i, r in enumerate(ranks)}
    boxes = [ctx.Queue() for _ in range(workers)]
    _PARENT[:] = [os.getpid()]
    _CHILDREN[:] = [ctx.Process(target=_child, args=(w, ranks[w::workers], owner, boxes, simulate, stand_in),
                                daemon=True)
                    for w in range(1, workers)]
    for p in _CHILDREN:
        p.start()
    relay, out = Relay(owner, 0, boxes, stand_in), {}
    try:
        for rank in ranks[::workers]:
            out[rank] = simulate(rank, relay)
            if done:
                done(rank)
            while relay.receive(block=False):  # what the children sent meanwhile
                pass
            _report(relay, out, done)
        while len(out) < len(ranks):
            relay.receive(block=True)
            _report(relay, out, done)
        for p in _CHILDREN:
            p.join(timeout=60)  # each has sent its last rank; `finally` ends one that does not exit
        return {r: out[r] for r in ranks}
    finally:
        for p in _CHILDREN:
            if p.is_alive():
                p.kill()
        _CHILDREN.clear()


def _report(relay: Relay, out: dict, done) -> None:
    for rank in sorted(set(relay.results) - set(out)):
        out[rank] = relay.results[rank]
        if done:
            done(rank)


def _child(me: int, ranks: list, owner: dict, boxes: list, simulate, stand_in) -> None:
    # one intra-op thread: the OpenMP pool the parent may have started does not survive the fork (a parallel
    # kernel would wait on it for ever), and the workers take the CPUs between them
    torch.set_num_threads(1)
    relay = Relay(owner, me, boxes, stand_in)
    rank = ranks[0]
    try:
        for rank in ranks:
            boxes[0].put(("run", rank, simulate(rank, relay)))
    except BaseException as e:  # every failure reaches the parent, which raises it
        try:
            pickle.loads(pickle.dumps(e))
        except Exception:  # an exception that cannot travel: its traceback does
            e = None
        boxes[0].put(("error", rank, traceback.format_exc(), e))
