"""torch.distributed.checkpoint (DCP) of a parallel model, saved so that a failed save never costs
the previous checkpoint.

`dcp.save` into an existing checkpoint directory overwrites its files one by one: a save interrupted
half way leaves neither the old nor the new checkpoint. Here every rank writes into a fresh sibling
directory `path + ".tmp-autopar"`, and only when all ranks have finished does rank 0 swap it in for
`path` (one atomic rename exchange on Linux). Each rank's step outcomes are agreed on (see
`autopar.program.consensus`), so every rank returns, or raises the same error, together.

    autopar.checkpoint.save_distributed(pm, "ckpt", optimizer=opt)   # every rank
    autopar.checkpoint.load_distributed(pm, "ckpt", optimizer=opt)   # any grid / strategy

DCP's `.metadata` file is a pickle: loading runs whatever code it names, so load only checkpoints
you (or a process you trust) wrote.
"""

from __future__ import annotations

import contextlib
import os
import shutil

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_state_dict)

from autopar.checkpoint import files as F
from autopar.program.consensus import AXES, agree, grid_group, on_rank0
from passes.ops.comm import guarded
from autopar.errors import CheckpointFileError, CheckpointNotFoundError, UsageError


def _state(pmodel, optimizer, flat: bool = True) -> dict:
    """The model's state_dict, and the optimizer's with `flat` in torch's flattened form ('state.<name>.
    exp_avg', 'param_groups.<name>.lr': keys per parameter, so that pipeline stages, each with its own
    parameters, never save one key with different values; `flat=False` reads checkpoints written
    before, whose param_groups are lists)."""
    if optimizer is None:
        return {"model": get_model_state_dict(pmodel)}
    msd, osd = get_state_dict(pmodel, optimizer, options=StateDictOptions(flatten_optimizer_state_dict=flat))
    return {"model": msd, "optim": osd}


def _dcp_group(grid):
    """DCP deduplicates replicated tensors across the ranks it is given: with data-parallel replicas or
    pipeline stages that is every process (the default group), otherwise the grid's group (bounded by
    its timeout)."""
    return None if getattr(grid, "dp", 1) > 1 or getattr(grid, "stages", 1) > 1 else grid_group(grid)


def prepare_staging(path: str, staging: str) -> None:
    if not path:
        raise UsageError("save_distributed path '' is empty: expected a directory to write the checkpoint into")
    if os.path.exists(path) and not os.path.isdir(path):
        raise UsageError(f"save_distributed path {path!r} is a file, not a directory: pass a directory path "
                         f"(a DCP checkpoint is a directory of files)")
    if os.path.isdir(staging) and not os.path.islink(staging):  # an interrupted save left it (the name is ours)
        shutil.rmtree(staging)
    elif os.path.lexists(staging):
        os.remove(staging)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    os.mkdir(staging)


@contextlib.contextmanager
def _dcp_errors(what: str):
    """DCP's CheckpointException derives from BaseException, so a training loop's `except Exception`
    misses it: re-raised as CheckpointFileError (an Exception) with each failing rank's error in one line."""
    try:
        yield
    except CheckpointException as e:
        parts = "; ".join(f"rank {r}: {type(exc).__name__}: {exc}" for r, (exc, _tb) in sorted(e.failures.items()))
        raise CheckpointFileError(f"{what} failed: {parts or e}") from e


def save_distributed(pmodel, path, optimizer=None) -> None:
    """DCP of `pmodel`'s state_dict (and `optimizer`'s, if given) at directory `path`; call on every
    rank (with a filesystem all ranks share). The previous checkpoint at `path` stays intact until
    every rank has written the new one; then the new one replaces it in one step. A `path` that is a
    symlink to a directory is written through (the directory it names is replaced). A second save
    into the same `path` while one is running is refused (a lock next to it, `path.lock-autopar`)."""
    grid = pmodel.grid
    path = os.fspath(path).rstrip("/") or "/"
    if os.path.islink(path):  # swap the directory it names, not the link (which would end up a directory)
        path = os.path.realpath(path)
    staging = path + F.TMP
    what = f"autopar.checkpoint.save_distributed({path!r})"
    lock = F.SaveLock(path + F.LOCK, f"save_distributed into {path!r}")
    agree(grid, on_rank0(grid, lock.acquire), f"{what}: locking {path}")
    try:
        agree(grid, _unlock_on_error(grid, lock, prepare_staging, path, staging), f"{what}: preparing {staging}")
        with guarded(grid, "torch.distributed.checkpoint.save", AXES, path), _dcp_errors(what):
            dcp.save(_state(pmodel, optimizer), checkpoint_id=staging, process_group=_dcp_group(grid))
        agree(grid, on_rank0(grid, _swap_then_unlock, staging, path, lock), f"{what}: moving {staging} into place")
    finally:
        lock.release()


def _unlock_on_error(grid, lock, fn, *args):
    """`on_rank0(fn)`, the lock released on failure before the ranks learn of it."""
    err = on_rank0(grid, fn, *args)
    if err is not None:
        lock.release()
    return err


def _swap_then_unlock(staging: str, path: str, lock) -> None:
    """Rank 0: the staging directory swapped in, then the lock released (before any rank returns)."""
    try:
        F.replace_dir(staging, path)
    finally:
        lock.release()


def load_distributed(pmodel, path, optimizer=None) -> None:
    """Fill `pmodel` (and `optimizer`) from the DCP checkpoint at `path`, whatever grid or strategy
    saved it; call on every rank. Load only checkpoints you trust (`.metadata` is a pickle)."""
    grid = pmodel.grid
    path = os.fspath(path)
    what = f"autopar.checkpoint.load_distributed({path!r})"
    missing = None
    if not os.path.isfile(os.path.join(path, ".metadata")):
        missing = CheckpointNotFoundError(f"{path}/.metadata not found: expected a directory written by "
                                          f"save_distributed or torch.distributed.checkpoint.save")
    agree(grid, missing, f"{what}: checking the checkpoint")
    saved = set(dcp.FileSystemReader(path).read_metadata().state_dict_metadata)
    flat = "optim.param_groups.0.params" not in saved  # written before optimizer states were saved flat
    state = _state(pmodel, optimizer, flat)
    request, copies = _tied_request(pmodel, state, saved)
    with guarded(grid, "torch.distributed.checkpoint.load", AXES, path), _dcp_errors(what):
        dcp.load(request, checkpoint_id=path, process_group=_dcp_group(grid))
    for fill in copies:
        fill()
    set_state_dict(pmodel, optimizer if optimizer is not None else [], model_state_dict=state["model"],
                   optim_state_dict=state.get("optim", {}),
                   options=StateDictOptions(flatten_optimizer_state_dict=flat))
    pmodel.materialized = True


def _tied_request(pmodel, state: dict, saved: set) -> tuple:
    """(what to ask DCP for, what to copy after it) where a pipelined model holds a second copy of a
    weight tied across stages (`PipelineModule.tied_copies`) that the checkpoint `saved` (its keys)
    lacks, as one saved without stages does: that copy and its optimizer state are read under the first
    name (or, where this rank holds the first too, copied from it after the load)."""
    copies = getattr(pmodel, "tied_copies", {})
    if not copies or any(f"model.{copy}" in saved for copy in copies):
        return state, []
    request = {k: dict(v) for k, v in state.items()}  # the same tensors, under the names asked for
    after: list = []
    for copy, first in copies.items():
        for part, where in request.items():
            for key in [k for k in where if k == copy or f".{copy}." in f".{k}"]:
                if part == "optim" and not (key.startswith("state.") or key.startswith("param_groups.")):
                    continue
                theirs = key.replace(copy, first, 1) if part == "model" else key.replace(f".{copy}.", f".{first}.", 1)
                mine = where.pop(key)
                if theirs in where:  # this rank holds the first copy too: filled from it after the load
                    after.append(lambda dst=mine, src=where, k=theirs: _copy_into(dst, src[k]))
                else:
                    where[theirs] = mine
    return request, after


def _copy_into(dst, src) -> None:
    if hasattr(dst, "copy_"):
        dst.copy_(src)
