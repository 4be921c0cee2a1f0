"""Captures shared by the ranks `autopar.dry_run` simulates one after another in one process.

Every rank of a job captures the same model on the same inputs: torch.export of a 70B Llama takes
seconds, its pipeline cut (an export of the whole model, then a run of it) tens of seconds, and a dry
run simulates dozens of ranks. Inside `shared_captures()` the first rank's capture (or cut) of a model
is kept and each later rank gets its own deep copy (the passes mark and rewrite the graph they are
given). A capture that asked for the rank while it traced (a model that branches on
`torch.distributed.get_rank()`) is the rank's own and is not shared: that branch is exactly what the
dry run's cross-rank checks look for. Outside `shared_captures()` (every real run) nothing is kept.
"""

from __future__ import annotations

import contextlib
import copy
import os
import sys

import torch
import torch.distributed as dist

from passes.compat import fake_deepcopy

__all__ = ["own", "shared", "shared_captures"]

_KEPT: list = []  # [(the active store {key: what the first rank captured}, its fake mode)], or []


@contextlib.contextmanager
def shared_captures(fake_mode=None):
    """Within it, `shared` keeps what it makes and hands deep copies of it to later callers; `fake_mode`:
    the FakeTensorMode whose tensors what it keeps may hold (copied as new fake tensors of it)."""
    _KEPT.append(({}, fake_mode))
    try:
        yield
    finally:
        _KEPT.pop()


def _shape_of(model: torch.nn.Module) -> tuple:
    """The model's structure as captures see it: its class, and each parameter's and buffer's name,
    shape and dtype (values aside: the ranks' copies of one model differ in none of these)."""
    return (type(model).__qualname__, model.training,
            tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in model.named_parameters()),
            tuple((n, tuple(b.shape), b.dtype) for n, b in model.named_buffers()))


def shared(kind: str, model: torch.nn.Module, key, make, copied: bool = True):
    """`make()`, or inside `shared_captures()` a deep copy of what an earlier call with the same `kind`, model
    structure and `key` made (unless that one read the rank while it ran). `copied=False`: that very object,
    whose parts the caller takes with `own` before changing them."""
    if not _KEPT:
        return make()
    store = _KEPT[-1][0]
    k = (kind, _shape_of(model), key)
    if k in store:
        return own(store[k]) if copied else store[k]
    with _rank_reads() as reads:
        made = make()
    if not reads:
        store[k] = own(made) if copied else made
    return made


def own(obj):
    """`obj` itself, or inside `shared_captures()` a deep copy of it (fake tensors copied as fake ones)."""
    if not _KEPT:
        return obj
    mode = _KEPT[-1][1]
    return copy.deepcopy(obj) if mode is None else fake_deepcopy(obj, mode)


_C10D = os.path.join("torch", "distributed", "distributed_c10d.py")
_TORCH = os.path.dirname(torch.__file__) + os.sep


def _from_torch(frame) -> bool:
    """Whether the code that asked for the rank (the first caller outside torch.distributed's functions that
    ask the group) is torch's own: its structured logs stamp records with the rank, and read nothing else."""
    while frame is not None and frame.f_code.co_filename.endswith(_C10D):
        frame = frame.f_back
    return frame is not None and frame.f_code.co_filename.startswith(_TORCH)


@contextlib.contextmanager
def _rank_reads():
    """A list that gains an entry each time a process group is asked for this process's rank meanwhile
    (`torch.distributed.get_rank` and its kin ask the group) by code other than torch's own."""
    reads: list = []
    own = vars(dist.ProcessGroup)["rank"]  # the class's own descriptor, put back as it was
    call = dist.ProcessGroup.rank

    def rank(pg):
        if not _from_torch(sys._getframe(1)):
            reads.append(pg)
        return call(pg)

    dist.ProcessGroup.rank = rank
    try:
        yield reads
    finally:
        dist.ProcessGroup.rank = own
