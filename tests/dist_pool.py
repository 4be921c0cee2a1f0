"""A pool of long-lived gloo processes for tests: spawn once, run many checks on every rank.

Start-up of 4 ranks costs ~3.5 s on a 2-core machine, so tests share one pool per world size. A
check is an importable function `fn(rank, *args)` run on every rank; its return values come back as
a list by rank. A rank that raises, or a pool that stops answering (a hang), fails the test with the
rank's traceback, and the pool is torn down so the next test gets a fresh one. A hang's failure
shows where every live rank was: each rank's Python stack, dumped by faulthandler on SIGUSR1 just
before the pool is torn down.
"""

from __future__ import annotations

import faulthandler
import os
import queue
import signal
import tempfile
import time
import traceback

import torch.multiprocessing as mp

from autopar.launch import free_port, init_local


def _worker(rank, world, port, inbox, outbox, parent, stacks):
    # kept open for the process's life: faulthandler writes to its descriptor from a signal handler
    dump = open(stacks, "w")
    faulthandler.register(signal.SIGUSR1, file=dump, all_threads=True)
    init_local(rank, world, port)
    while True:
        try:
            task = inbox.get(timeout=2.0)
        except queue.Empty:
            if os.getppid() != parent:  # the test process was killed: do not outlive it
                return
            continue
        if task is None:
            return
        fn, args, kwargs = task
        try:
            outbox.put((rank, True, fn(rank, *args, **kwargs)))
        except BaseException:  # reported to the parent test, which fails with this text
            outbox.put((rank, False, traceback.format_exc()))


def _fresh_worker(fn, stacks, rank, world, port, *args):
    dump = open(stacks, "w")  # kept open: faulthandler writes to its descriptor from a signal handler
    faulthandler.register(signal.SIGUSR1, file=dump, all_threads=True)
    fn(rank, world, port, *args)


class Fresh(list):
    """The processes of spawn_fresh, by rank, with the files their stacks are dumped to."""

    def __init__(self, procs, stacks):
        super().__init__(procs)
        self.stacks = stacks

    def join(self, ranks=None, timeout: float = 120) -> str:
        """Waits up to `timeout` s in all for `ranks` (default: all) to exit. Returns '' when they did,
        else where each one still running was (faulthandler dump), for the test's assertion message.
        Every process still alive is then killed: a rank meant to sleep through the check included."""
        ranks = list(range(len(self)) if ranks is None else ranks)
        deadline = time.time() + timeout
        for r in ranks:
            self[r].join(timeout=max(0.1, deadline - time.time()))
        hung = [(r, self[r]) for r in ranks if self[r].is_alive()]
        where = _where(hung, self.stacks) if hung else ""
        for p in self:
            if p.is_alive():
                p.kill()
                p.join(timeout=10)  # reaped: nothing left running when the test goes on
        for path in self.stacks:
            if os.path.exists(path):
                os.remove(path)
        return f"rank(s) {[r for r, _ in hung]} still running after {timeout:.0f} s:\n{where}" if hung else ""


def spawn_fresh(fn, world: int, *args) -> Fresh:
    """`world` new processes running fn(rank, world, port, *args), each joining a group of its own:
    for checks that kill ranks or break their group. Returns the started processes; `.join()` waits
    for them and reports where a hung one was."""
    ctx = mp.get_context("spawn")
    port = free_port()
    stacks = [tempfile.mkstemp(prefix=f"autopar-fresh-rank{r}-", suffix=".txt")[1] for r in range(world)]
    procs = [ctx.Process(target=_fresh_worker, args=(fn, stacks[r], r, world, port, *args)) for r in range(world)]
    for p in procs:
        p.start()
    return Fresh(procs, stacks)


def _where(live, stacks, tail: int = 12) -> str:
    """The innermost `tail` frames of the main thread of every (rank, process) in `live`, from a
    faulthandler dump (each process registered SIGUSR1 to write to stacks[rank]). Each process dumps
    once (it is torn down after): its file is read whole, never truncated first."""
    for _, p in live:
        os.kill(p.pid, signal.SIGUSR1)
    time.sleep(1.0)  # the handlers write asynchronously
    out = []
    for r, _ in live:
        text = open(stacks[r]).read().strip()
        blocks = text.split("\n\n")
        main = next((b for b in blocks if "most recent call first" in b and "Current thread" in b), blocks[0])
        lines = main.splitlines()
        out.append(f"rank {r} was at (innermost first):\n" + "\n".join(lines[1:tail + 1]))
    return "\n".join(out) or "(no rank alive to ask)"


def _ready(rank):
    return rank


def start(world: int, tries: int = 3) -> "Pool":
    """A pool whose ranks all joined their group: a port chosen free can be taken by another process
    before rank 0 binds it, and a rank that dies at start would otherwise fail the next test."""
    for attempt in range(tries):
        pool = Pool(world)
        try:
            pool.run(_ready)
            return pool
        except AssertionError:
            pool.close(force=True)
            if attempt == tries - 1:
                raise
    raise AssertionError("unreachable")


class Pool:
    def __init__(self, world: int):
        ctx = mp.get_context("spawn")
        self.world = world
        self.inboxes = [ctx.Queue() for _ in range(world)]
        self.outbox = ctx.Queue()
        port = free_port()
        self.stacks = [tempfile.mkstemp(prefix=f"autopar-pool-rank{r}-", suffix=".txt")[1] for r in range(world)]
        self.procs = [ctx.Process(target=_worker, args=(r, world, port, self.inboxes[r], self.outbox, os.getpid(),
                                                        self.stacks[r]), daemon=True)
                      for r in range(world)]
        for p in self.procs:
            p.start()
        self.broken = False

    def run(self, fn, *args, timeout: float = 300, **kwargs):
        """fn(rank, *args, **kwargs) on every rank; returns the results by rank."""
        for box in self.inboxes:
            box.put((fn, args, kwargs))
        results, errors = [None] * self.world, []
        for _ in range(self.world):
            try:
                rank, ok, value = self._next(fn, timeout)
            except AssertionError as hang:
                if not errors:
                    raise
                rank, tb = errors[0]  # the others hung after this rank raised: its traceback is the story
                raise AssertionError(f"{fn.__name__} failed on rank {rank} (then: {hang}):\n{tb}") from None
            if ok:
                results[rank] = value
            else:
                errors.append((rank, value))
                if len(errors) == 1:  # the other ranks may now wait forever in a collective
                    timeout = min(timeout, 20)
        if errors:
            self.close(force=True)
            rank, tb = errors[0]
            raise AssertionError(f"{fn.__name__} failed on rank {rank}:\n{tb}")
        return results

    def _next(self, fn, timeout: float):
        waited = 0.0
        while True:
            try:
                return self.outbox.get(timeout=1.0)
            except queue.Empty:
                waited += 1.0
            dead = [r for r, p in enumerate(self.procs) if not p.is_alive()]
            if dead or waited >= timeout:
                where = self.where()
                self.close(force=True)
                why = f"rank(s) {dead} died" if dead else f"no answer within {timeout:.0f} s (hang?)"
                raise AssertionError(f"{fn.__name__}: {why}\n{where}")

    def where(self, tail: int = 12) -> str:
        """The innermost `tail` frames of every live rank's main thread, from a faulthandler dump."""
        return _where([(r, p) for r, p in enumerate(self.procs) if p.is_alive()], self.stacks, tail)

    def close(self, force: bool = False):
        self.broken = True
        if not force:
            for box in self.inboxes:
                box.put(None)
        for p in self.procs:
            p.join(timeout=0 if force else 10)
            if p.is_alive():
                p.kill()
        for path in self.stacks:
            if os.path.exists(path):
                os.remove(path)
