"""A flight recorder of this process's collectives, and the hang diagnosis built on it.

Every collective autopar issues passes through `passes.ops.comm.guarded`, which notes it here: a bounded
ring buffer (`FLIGHT_CALLS` entries, 2,000 by default: `AUTOPAR_FLIGHT_CALLS`; 0 turns it off) of `Call`s, each with its
number among the calls on its process group (`seq`), the operation, the group (its global ranks and the
mesh axis it spans), the tensor's shape and dtype, the graph node or other CommLog tag it was issued for,
and whether it is in progress, done or failed. A wait for an asynchronous collective is noted as a call of
its own with no number (it is where a rank blocks, not a new collective).

When a collective fails on a backend error (a timeout, a peer that exited), `diagnose` runs before the
CollectiveError is raised: the rank writes its buffer to a JSON file (`AUTOPAR_FLIGHT_DIR`, else the system's
temporary directory) and to the job's store (the TCPStore torch.distributed started with, which needs no
process group), then reads the reports of the failing group's members -- and of the members of every group a
reporter is blocked in -- for up to `REPORT_WAIT_S` seconds, and says:

- which ranks did not report (they are not inside one of autopar's collectives: running other code, stuck
  in the user's code, or gone);
- the first disagreement: on which group, at which call number, one member issued something other than
  another (op, shape, dtype or graph node, with the module the node came from: `Grid.places`), or had not
  issued it at all;
- where every reporting rank is blocked (op, call number, group, graph node).

Nothing here reads a tensor's values or synchronises the device: a record is a few Python values per call.
"""

from __future__ import annotations

import collections
import json
import os
import sys
import tempfile
import threading
import time

import torch.distributed as dist

from passes.compat import default_store

__all__ = ["Call", "FLIGHT", "FLIGHT_CALLS", "HANG_AFTER_S", "HANG_EXIT", "HANG_EXIT_CODE", "REPORT_WAIT_S",
           "diagnose", "explain", "members_of", "record", "watch"]

FLIGHT_CALLS = int(os.environ.get("AUTOPAR_FLIGHT_CALLS", "2000"))  # entries kept per process
# a collective in progress for this many seconds is diagnosed by a watcher thread while it still waits (`watch`);
# unset: only when the collective fails
HANG_AFTER_S = float(os.environ.get("AUTOPAR_HANG_AFTER", "0")) or None
REPORT_WAIT_S = float(os.environ.get("AUTOPAR_FLIGHT_WAIT", "5"))  # how long a failing rank waits for reports
# with AUTOPAR_HANG_AFTER: after its diagnosis the watcher ends the process with this status, so that the
# launcher (torchrun) stops the job: a step timeout of its own, shorter than the process group's
HANG_EXIT = os.environ.get("AUTOPAR_HANG_EXIT", "0") not in ("", "0")
HANG_EXIT_CODE = 3
_KEY = "autopar/flight/{}"
_SHOWN = 8  # ranks named per line of the diagnosis (the rest counted)

_AXIS_NAMES = {0: "column group", 1: "row group", 2: "context-parallel group", "dp": "replica group",
               "pp": "pipeline group", "depth": "depth group"}


class Call:
    """One collective (or a wait for one) this process issued. `seq`: its number among the calls on its
    group, from 1 (None for a wait); `state`: 'in progress', 'done' or 'failed'."""

    __slots__ = ("seq", "op", "group", "members", "shape", "dtype", "node", "state", "time", "waiting", "place")

    def __init__(self, seq, op, group, members, shape, dtype, node, place=""):
        self.seq, self.op, self.group, self.members = seq, op, group, members
        self.shape, self.dtype, self.node, self.place = shape, dtype, node, place
        self.state, self.time, self.waiting = "in progress", time.time(), False

    def key(self) -> tuple:
        """What every member of the group must agree on at this call number."""
        return self.op, self.shape, self.dtype, self.node

    def node_text(self) -> str:
        """The graph node (or other tag) it was issued for, and the module that node came from."""
        return f"{self.node!r}" + (f" ({self.place})" if self.place else "")

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__slots__}

    def __str__(self) -> str:
        what = self.op if self.seq is None else f"{self.op} #{self.seq}"
        return f"{what}{self.tensor_text()} on {_group_text(self.group, self.members)} for {self.node_text()}"

    def tensor_text(self) -> str:
        return f" {list(self.shape)} {self.dtype}" if self.shape is not None else ""


def _group_text(group: str, members) -> str:
    if not members:
        return group
    shown = ", ".join(map(str, members[:_SHOWN])) + (f", ... ({len(members)} ranks)" if len(members) > _SHOWN else "")
    return f"{group} (ranks {shown})"


class Flight:
    """This process's ring buffer of collectives (`FLIGHT`)."""

    def __init__(self, size: int = FLIGHT_CALLS):
        self.calls: collections.deque = collections.deque(maxlen=size)
        self.counts: dict = {}  # (group name, members) -> calls issued on it

    def record(self, op: str, group: str, members, tensor=None, node: str = "", waiting: bool = False,
               place: str = "") -> Call:
        shape = tuple(tensor.shape) if tensor is not None else None
        dtype = str(tensor.dtype).removeprefix("torch.") if tensor is not None else None
        if waiting:  # the launch it waits for (a few calls back at most) gives its number and shape
            seq, node = None, str(node)
            for back, c in enumerate(reversed(self.calls)):
                if back >= 16:
                    break
                if c.seq is not None and c.op == op and c.members == members and c.node == node:
                    seq, shape, dtype = c.seq, c.shape, c.dtype
                    break
            call = Call(seq, "wait for " + op, group, members, shape, dtype, node, place)
            call.waiting = True
        else:
            k = (group, members)
            seq = self.counts[k] = self.counts.get(k, 0) + 1
            call = Call(seq, op, group, members, shape, dtype, str(node), place)
        self.calls.append(call)
        return call


FLIGHT = Flight()

_MEMBERS: dict = {}  # id(process group) -> (the group, its global ranks)


def members_of(grid, axis):
    """(a name for the group a collective over `axis` of `grid` runs on, its global ranks or None)."""
    name = _AXIS_NAMES.get(axis, "grid")
    group = None
    try:
        if isinstance(axis, int):
            group = grid.group(axis)
        elif axis == "dp":
            group = grid.dp_group
        elif axis == "pp":
            group = grid.pp_group
        elif axis != "depth":
            group = getattr(grid, "world_group", None) or (dist.group.WORLD if dist.is_initialized() else None)
    except (AttributeError, IndexError, KeyError, RuntimeError, ValueError):
        group = None
    if group is None:
        return name, None
    got = _MEMBERS.get(id(group))
    if got is None or got[0] is not group:
        try:
            got = _MEMBERS[id(group)] = (group, tuple(dist.get_process_group_ranks(group)))
        except (RuntimeError, ValueError):
            return name, None
    return name, got[1]


def record(grid, what: str, axis, tag: str, tensor=None, waiting: bool = False) -> Call:
    """Note a collective (or a wait for one) about to run over `axis` of `grid`."""
    if FLIGHT.calls.maxlen == 0:  # AUTOPAR_FLIGHT_CALLS=0: the recorder is off
        return Call(None, what, "", None, None, None, tag)
    if HANG_AFTER_S is not None and _WATCHER is None:
        watch(HANG_AFTER_S)
    name, members = members_of(grid, axis)
    return FLIGHT.record(what, name, members, tensor, tag, waiting, getattr(grid, "places", {}).get(tag, ""))


def _report_dir() -> str:
    return os.environ.get("AUTOPAR_FLIGHT_DIR") or tempfile.gettempdir()


def diagnose(call: Call, window_s: float) -> str:
    """Publish this rank's buffer, gather the reports of the ranks that matter, and say what went wrong
    (`explain`); '' where there is no process group or store. `window_s`: how old a report may be and still
    belong to this failure (the group's timeout and the wait)."""
    if not dist.is_initialized():
        return ""
    rank, start = dist.get_rank(), time.monotonic()
    mine = {"rank": rank, "time": time.time(), "calls": [c.as_dict() for c in list(FLIGHT.calls)]}  # a copy:
    # the watcher runs this in its own thread
    path = os.path.join(_report_dir(), f"autopar-flight-rank{rank}.json")
    try:
        with open(path, "w") as f:
            json.dump(mine, f)
    except OSError:
        path = ""
    if default_store is None:  # torch no longer offers it: only this rank's own view
        return explain({rank: mine}, set(), path, 0.0)
    try:
        store = default_store()
        store.set(_KEY.format(rank), json.dumps(mine))
    except Exception:  # the store's host is gone: only this rank's own view  # noqa: BLE001
        return explain({rank: mine}, set(), path, 0.0)
    reports = {rank: mine}
    want = set(call.members or range(dist.get_world_size()))
    oldest = mine["time"] - window_s
    deadline = start + REPORT_WAIT_S
    while True:
        for r in sorted(want - reports.keys()):
            try:
                if store.check([_KEY.format(r)]):
                    rep = json.loads(store.get(_KEY.format(r)))
                    if rep["time"] >= oldest:
                        reports[r] = rep
                        for c in rep["calls"]:  # the groups it is blocked in matter too
                            if c["state"] == "in progress" and c["members"]:
                                want.update(c["members"])
            except Exception:  # noqa: BLE001 (a store that stops answering: report what is known)
                deadline = 0
        if want <= reports.keys() or time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    return explain(reports, want - reports.keys(), path, time.monotonic() - start)


def _calls(report: dict) -> list:
    return [_call_of(c) for c in report["calls"]]


def _call_of(d: dict) -> Call:
    c = Call(d["seq"], d["op"], d["group"], tuple(d["members"]) if d["members"] else None,
             tuple(d["shape"]) if d["shape"] is not None else None, d["dtype"], d["node"], d.get("place", ""))
    c.state, c.time, c.waiting = d["state"], d["time"], d.get("waiting", False)
    return c


def _first_disagreement(reports: dict) -> str:
    """The earliest call number on any group at which two reporting members differ, or one has issued it
    and a member has not; '' when every group's calls agree as far as the buffers reach."""
    by_group: dict = {}  # (name, members) -> {rank: {seq: Call}}
    for rank, rep in reports.items():
        for c in _calls(rep):
            if c.seq is not None and c.members and not c.waiting:
                by_group.setdefault((c.group, c.members), {}).setdefault(rank, {})[c.seq] = c
    found = []  # (a member issued something else: 0, or had not issued it: 1; when; ...)
    for (name, members), seen in by_group.items():
        there = [r for r in members if r in reports]
        if len(there) < 2 and len(members) > 1:
            continue
        lows = [min(seen.get(r, {0: None})) for r in there]
        highs = {r: max(seen.get(r, {0: None})) for r in there}
        for seq in range(max(lows), max(highs.values()) + 1):
            issued = {r: seen.get(r, {}).get(seq) for r in there}
            keys = {c.key() for c in issued.values() if c is not None}
            missing = [r for r, c in issued.items() if c is None]
            if len(keys) > 1 or missing:
                when = min(c.time for c in issued.values() if c is not None)
                found.append((0 if len(keys) > 1 else 1, when, name, members, seq, issued, highs))
                break
    if not found:
        return ""
    # a member that issued another call first is the cause; one that is behind may only wait elsewhere
    _, _, name, members, seq, issued, highs = min(found, key=lambda f: f[:2])
    lines = [f"first disagreement: {_group_text(name, members)}, call #{seq}:"]
    for r, c in issued.items():
        lines.append(f"  rank {r} has issued only {highs[r]} call(s) on this group" if c is None else
                     f"  rank {r} issued {c.op}{c.tensor_text()} for {c.node_text()}")
    return "\n  ".join(lines)


def explain(reports: dict, silent: set, path: str, waited_s: float) -> str:
    """The diagnosis text from the reports gathered (`diagnose`)."""
    heard = sorted(reports)
    lines = [f"hang diagnosis: {len(heard)} rank(s) reported in {waited_s:.1f} s ({_ranks(heard)})"]
    if silent:
        lines.append(f"rank(s) {_ranks(sorted(silent))} did not report: not inside one of autopar's collectives "
                     f"(running other code, stuck in the user's code or another library's collective, or exited)")
    first = _first_disagreement(reports)
    if first:
        lines.append(first)
    for r in heard:
        blocked = [c for c in _calls(reports[r]) if c.state == "in progress"]
        if blocked:
            c = blocked[-1]
            lines.append(f"rank {r} {'waits for' if c.waiting else 'waits in'} "
                         f"{str(c).removeprefix('wait for ')}")
        else:
            done = _calls(reports[r])
            lines.append(f"rank {r} is in no collective; its last: {done[-1]}" if done else
                         f"rank {r} has issued no collective")
    if len(lines) > 4 + _SHOWN:
        lines = lines[:4 + _SHOWN] + [f"... ({len(lines) - 4 - _SHOWN} more lines in the buffers)"]
    if path:
        lines.append(f"each rank's last {FLIGHT.calls.maxlen} collectives: {path} (rank {dist.get_rank()}; "
                     f"the others write theirs under the same name with their rank)")
    return "\n  ".join(lines)


def _ranks(ranks: list) -> str:
    return ", ".join(map(str, ranks[:_SHOWN])) + (f", ... ({len(ranks)} in all)" if len(ranks) > _SHOWN else "")


_WATCHER: threading.Thread | None = None


def watch(seconds: float) -> None:
    """Start this process's watcher (once): a daemon thread that, when the innermost collective in progress
    has waited `seconds`, diagnoses it (`diagnose`) while it still waits, and writes the text to stderr and to
    `autopar-hang-rank<N>.txt` beside the buffer's file. It runs where a timed-out collective never raises in
    Python (NCCL without TORCH_NCCL_BLOCKING_WAIT, whose watchdog aborts the process instead) and long before
    the process group's own timeout (30 minutes by default). It is armed by the first collective of a compiled
    program that completes (one whose graph node `Grid.places` knows), so start-up's waits (rank 0 searching
    while the others wait for its choice) are not taken for hangs. Each stuck call is diagnosed once."""
    global _WATCHER
    if _WATCHER is not None:
        return
    _WATCHER = threading.Thread(target=_watch, args=(float(seconds),), name="autopar-flight-watcher", daemon=True)
    _WATCHER.start()


def _watch(seconds: float) -> None:
    told: set = set()
    armed = False
    while True:
        time.sleep(min(1.0, seconds / 4))
        calls = list(FLIGHT.calls)  # one C-level copy under the GIL: the main thread appends meanwhile
        armed = armed or any(c.place and c.state == "done" for c in calls)
        blocked = [c for c in calls if c.state == "in progress"]
        if not armed or not blocked or id(blocked[-1]) in told:
            continue
        call = blocked[-1]
        if time.time() - call.time < seconds:
            continue
        told.add(id(call))
        try:
            text = diagnose(call, seconds + 2 * REPORT_WAIT_S)
            rank = dist.get_rank() if dist.is_initialized() else 0
            head = f"autopar: rank {rank} has waited {time.time() - call.time:.0f} s in {call}"
            with open(os.path.join(_report_dir(), f"autopar-hang-rank{rank}.txt"), "w") as f:
                f.write(head + "\n  " + text + "\n")
            print(head + "\n  " + text, file=sys.stderr, flush=True)
        except Exception as e:  # noqa: BLE001 (the watcher must never take the process down)
            print(f"autopar: the hang watcher failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        if HANG_EXIT:
            _exit(seconds)


def _exit(seconds: float) -> None:
    """AUTOPAR_HANG_EXIT=1: end this process after its diagnosis (status `HANG_EXIT_CODE`), once the other
    ranks, diagnosing about now, can have read its report; rank 0, which hosts the job's store, last."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    time.sleep(REPORT_WAIT_S if rank else 2 * REPORT_WAIT_S + 1)
    print(f"autopar: rank {rank} ends its process after a collective waited {seconds:g} s "
          f"(AUTOPAR_HANG_EXIT=1; exit status {HANG_EXIT_CODE})", file=sys.stderr, flush=True)
    os._exit(HANG_EXIT_CODE)
