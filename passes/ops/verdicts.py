"""Run-time checks without a host sync: verdicts computed on the device, read a call later.

A check that reads a value on the host (`int(count)`, `bool(bad.any())`, `.tolist()`) makes the host
wait for the device to compute it: on an accelerator the step stops queueing work until then. autopar's
run-time checks (the inputs agree across the grid, ids and targets lie in their tables) compute their
verdict on the device either way; *when* it is read is the `checks` option:

- 'now': at once, a device-to-host sync per check; the error is raised by the call that failed it.
- 'late': the verdict is copied to the host without waiting (pinned memory, an event) and read at the
  start of the next call, when the device has long finished it (or at `flush()`); the error names the
  call that failed it. No sync in the step.
- 'auto' (the default): 'now' on the CPU, where reading a value waits for nothing, 'late' elsewhere.

Every verdict is the same on every rank of the group that computed it (the ids are whole on every rank,
a target count is all-reduced, the inputs' digests are all-reduced), so every rank raises at the same
call and no rank is left waiting in a collective.

>>> import torch
>>> v = Verdicts()
>>> v.check(torch.tensor([3]), lambda got: got[0] < 5, lambda got: ValueError(f"{got[0]} too big"), "late")
>>> v.check(torch.tensor([7]), lambda got: got[0] < 5, lambda got: ValueError(f"{got[0]} too big"), "late")
>>> try:
...     v.flush()
... except ValueError as e:
...     print(e)
7 too big (found by the previous call's check)
"""

from __future__ import annotations

import weakref
from typing import Callable

import torch

from passes.compat import is_fake

__all__ = ["MODES", "Verdicts", "VERDICTS", "is_host_buffer", "mark_host"]

MODES = ("auto", "now", "late")

# id -> tensor: host copies of verdicts and other host-only values; reading them waits on nothing
_HOST: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def mark_host(t: torch.Tensor) -> torch.Tensor:
    """`t`, noted as a host-only value (a verdict's host copy, a draw of the CPU generator): reading it
    is no host sync on any device, and `autopar.count_host_syncs` leaves it out."""
    _HOST[id(t)] = t
    return t


def is_host_buffer(t) -> bool:
    """Whether `t` was noted by `mark_host`."""
    return _HOST.get(id(t)) is t


class Verdicts:
    """The pending verdicts of this process, read in the order they were made."""

    def __init__(self):
        self.mode = "auto"
        self.pending: list = []  # (host copy, event or None, ok, error)

    def now(self, device: torch.device, mode: str | None = None) -> bool:
        """Whether a verdict computed on `device` is read at once under `mode` (default: this process's)."""
        mode = mode or self.mode
        return mode == "now" or (mode == "auto" and device.type == "cpu")

    def check(self, values: torch.Tensor, ok: Callable[[list], bool], error: Callable[[list], Exception],
              mode: str | None = None) -> None:
        """Raise `error(values.tolist())` unless `ok(values.tolist())`: at once, or (late) at the next
        `poll`. `values`: a small 1-D tensor computed on the device."""
        if values.is_meta or is_fake(values):  # shapes without values (a dry run): nothing to read
            return
        if self.now(values.device, mode):
            got = values.tolist()
            if not ok(got):
                raise error(got)
            return
        values = values.detach()
        if values.device.type == "cpu":
            host, event = values.clone(), None
        else:
            host = torch.empty(values.shape, dtype=values.dtype, pin_memory=torch.cuda.is_available())
            host.copy_(values, non_blocking=True)
            event = torch.Event(device=values.device)
            event.record()
        mark_host(host)
        self.pending.append((host, event, ok, error))

    def poll(self, wait: bool = False) -> None:
        """Read the pending verdicts the device has finished (every one with `wait`); raise the first
        failed one's error, naming it as the previous call's."""
        keep = []
        failed = None
        for host, event, ok, error in self.pending:
            if event is not None and not event.query():
                if not wait:
                    keep.append((host, event, ok, error))
                    continue
                event.synchronize()
            got = host.tolist()
            if failed is None and not ok(got):
                failed = error(got)
        self.pending = keep
        if failed is not None:
            self.pending = []  # the step that raised them is over: what it left pending is moot
            if failed.args and isinstance(failed.args[0], str):  # its message, said to come from a call before
                failed.args = (f"{failed.args[0]} (found by the previous call's check)", *failed.args[1:])
            raise failed from None

    def flush(self) -> None:
        """Wait for every pending verdict and raise the first failed one (the end of training, a save)."""
        self.poll(wait=True)


VERDICTS = Verdicts()  # this process's: the checks of every parallelized model it calls

