"""Host syncs, counted: where a step makes the host wait for the device.

On an accelerator the host queues kernels ahead of the device; reading a tensor's value on the host
(`t.item()`, `int(t)`, `bool(t)`, `t.tolist()`, `t.numpy()`) or an op whose output shape depends on
values (a boolean index, `nonzero`, `masked_select`, `unique`) makes it wait until the device has caught
up, and the queue runs dry. `count_host_syncs()` counts those reads by the code that made them, on any
device (on the CPU each one stands for the sync it would be on an accelerator), leaving out the host
copies of autopar's deferred verdicts (`passes.ops.verdicts`), which the device filled without a wait.

    with autopar.count_host_syncs() as syncs:
        loss = pmodel(ids, labels=ids).loss
        loss.backward()
    print(syncs.total, syncs.sites)       # e.g. 0 Counter()

`flush_checks()` reads the verdicts the last call left pending (the `checks` option), raising the error
of one that failed: call it after the last step.
"""

from __future__ import annotations

import collections
import contextlib
import os
import sys

import torch

from passes.ops.verdicts import VERDICTS, is_host_buffer
from autopar.program.audit import package_dirs

__all__ = ["SyncCount", "count_host_syncs", "flush_checks"]

# host reads of a tensor's values, and ops whose output's shape depends on them
_READS = ("item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__")
_SHAPED = ("nonzero", "masked_select", "unique", "unique_consecutive")
_TORCH = os.sep + "torch" + os.sep
_OWN = package_dirs()  # autopar/, passes/


class SyncCount:
    """The host syncs seen: `total`, `own` (those made by autopar's own code, `autopar/` and `passes/`), and
    `sites`, a Counter of "file.py:line (what)" of the first frame outside torch that made each."""

    def __init__(self):
        self.total = 0
        self.own = 0
        self.sites: collections.Counter = collections.Counter()

    def add(self, what: str) -> None:
        self.total += 1
        frame = sys._getframe(2)
        while frame is not None and (_TORCH in frame.f_code.co_filename or frame.f_code.co_filename == __file__):
            frame = frame.f_back
        where = f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}" if frame is not None else "?"
        self.own += frame is not None and frame.f_code.co_filename.startswith(_OWN)
        self.sites[f"{where} ({what})"] += 1

    def __repr__(self) -> str:
        return f"SyncCount(total={self.total}, own={self.own}, sites={dict(self.sites)})"


def _counted(count: SyncCount, name: str, orig, index: bool = False):
    def read(t, *args, **kwargs):
        if index:  # t[mask]: a boolean mask's selection has a shape only its values decide
            key = args[0] if args else None
            keys = key if isinstance(key, tuple) else (key,)
            if any(isinstance(k, torch.Tensor) and k.dtype == torch.bool for k in keys):
                count.add("boolean index")
        elif isinstance(t, torch.Tensor) and not is_host_buffer(t):
            count.add(name)
        return orig(t, *args, **kwargs)
    return read


@contextlib.contextmanager
def count_host_syncs():
    """Count the host syncs made inside the block: Python-level calls of the reads above on tensors
    (torch.Tensor's methods, patched while the block runs; eager code, autopar's custom ops' bodies
    included; under torch.compile, count an eager run)."""
    count = SyncCount()
    saved = {}
    patched = [(torch.Tensor, n, False) for n in _READS + _SHAPED] + [(torch.Tensor, "__getitem__", True)] + \
        [(torch, n, False) for n in _SHAPED]
    try:
        for owner, name, index in patched:
            orig = getattr(owner, name)
            saved[(owner, name)] = orig
            setattr(owner, name, _counted(count, name, orig, index))
        yield count
    finally:
        for (owner, name), orig in saved.items():
            setattr(owner, name, orig)


def flush_checks() -> None:
    """Wait for the verdicts of the last call's checks (the `checks` option; pending where they are read
    late) and raise the error of the first that failed."""
    VERDICTS.flush()
