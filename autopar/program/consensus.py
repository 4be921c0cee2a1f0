"""Every rank learns whether any rank failed, so that all raise the same error and none is left
waiting in a collective that a failed rank will never join.

A checkpoint save mixes collectives (gathers every rank joins) with file work that one rank does
alone. A failure on that rank alone (a target that is a file, a full disk) used to leave the others
blocked in the next gather until the process group's timeout. Instead, after each step that can fail
locally, all ranks exchange a tiny outcome and raise together:

    err = None
    if grid.rank == 0:
        try:
            write_file()
        except OSError as e:
            err = e
    agree(grid, err, "save_pretrained: writing model.safetensors")  # raises on every rank, or on none

The exchange runs over the grid's group (created with `parallelize(..., timeout=)`, so a rank that
never arrives makes the others raise a CollectiveError after that timeout) and, with data-parallel
replicas, across the replicas too.
"""

from __future__ import annotations

import builtins

import torch.distributed as dist

from autopar import errors
from autopar.errors import (AutoparError, CheckpointFileError, CheckpointNotFoundError, CheckpointPermissionError,
                            MemoryLimitError, RankFailedError, UnsupportedError, UsageError)
from passes.ops.comm import guarded

AXES = "(r, c)"  # the exchange spans both mesh axes (all ranks of the grid)


def grid_group(grid):
    """The process group of this grid's R*C ranks (None: the default group, which is the same ranks
    when there is one replica and no timeout was given)."""
    return getattr(grid, "world_group", None)


def agree(grid, failure: BaseException | None, what: str) -> None:
    """Raise on every rank if `failure` is set on any rank: the lowest failing rank's error (`rebuilt`
    from its class name) and text, prefixed with `what` and that rank."""
    mine = None if failure is None else (grid.rank, type(failure).__name__, str(failure))
    first = mine
    if dist.is_initialized():
        first = _lowest(_outcomes(grid, mine, grid_group(grid), what))
        if getattr(grid, "dp", 1) > 1:  # the replicas learn each other's outcome
            first = _lowest(_outcomes(grid, first, grid.dp_group, what))
        if getattr(grid, "pp_group", None) is not None:  # and the pipeline stages
            first = _lowest(_outcomes(grid, first, grid.pp_group, what))
    if first is None:
        return
    rank, kind, text = first
    raise rebuilt(kind, f"{what} failed on rank {rank}: {text}") from failure


# a builtin error another rank raised -> the class of ours every rank raises for it (the first of its
# MRO listed): each derives from that builtin, so an `except OSError` written for it still catches it
FOR_BUILTIN = {"PermissionError": CheckpointPermissionError, "FileNotFoundError": CheckpointNotFoundError,
               "OSError": CheckpointFileError, "MemoryError": MemoryLimitError, "ValueError": UsageError,
               "NotImplementedError": UnsupportedError}


def rebuilt(kind: str, message: str) -> AutoparError:
    """The error a rank raised, for every rank to raise, from its class name `kind` and `message`:
    that class when it is one of autopar's (all are built from a message alone), the one of ours
    `FOR_BUILTIN` names for a builtin, else RankFailedError.

    >>> type(rebuilt("ShardingError", "x")).__name__, type(rebuilt("IsADirectoryError", "x")).__name__
    ('ShardingError', 'CheckpointFileError')
    >>> type(rebuilt("CheckpointException", "x")).__name__
    'RankFailedError'
    """
    cls = getattr(errors, kind, None)
    if isinstance(cls, type) and issubclass(cls, AutoparError):
        return cls(message)
    builtin = getattr(builtins, kind, None)
    for base in builtin.__mro__ if isinstance(builtin, type) else ():
        if base.__name__ in FOR_BUILTIN:
            return FOR_BUILTIN[base.__name__](message)
    return RankFailedError(message)


def on_rank0(grid, fn, *args) -> BaseException | None:
    """Run fn(*args) on rank 0 only; the exception it raised (or None), for `agree`."""
    if grid.rank != 0:
        return None
    try:
        fn(*args)
    except Exception as e:  # every rank raises it, in agree
        return e
    return None


def decided_once(decide, decider: bool, send, guard):
    """What `decide()` returns on the one rank where `decider` is true (a search: one run spares the
    others' CPU, and a search stopped by its time budget could end elsewhere on another rank), on
    every rank. `send(box)` carries the one-item list `box` from the decider to every other rank (one
    broadcast, or a route of them), under `guard` (as `all_gather_objects`). If `decide` raises, every
    rank raises the error `rebuilt` from its class name and text (the decider's chained to the one it
    caught): none waits for a result that never comes."""
    box: list = [None]
    failure = None
    if decider:
        try:
            box[0] = ("ok", decide())
        except Exception as e:  # sent, then raised on every rank below
            failure, box[0] = e, ("error", type(e).__name__, str(e))
    with guard:
        send(box)
    if box[0][0] == "error":
        raise rebuilt(box[0][1], box[0][2]) from failure
    return box[0][1]


def all_gather_objects(obj, group, guard) -> list:
    """Every rank's `obj` (any picklable value), in the rank order of `group` (None: the default
    group). `guard`: the context manager that turns a failed or timed-out exchange into the caller's
    error (`passes.ops.comm.guarded` once a grid exists, `guards.handshake` before)."""
    out = [None] * dist.get_world_size(group)
    with guard:
        dist.all_gather_object(out, obj, group=group)
    return out


def _outcomes(grid, obj, group, what: str) -> list:
    return all_gather_objects(obj, group, guarded(grid, "all-gather of the outcome", AXES, what))


def _lowest(outcomes: list):
    failed = [o for o in outcomes if o is not None]
    return min(failed) if failed else None
