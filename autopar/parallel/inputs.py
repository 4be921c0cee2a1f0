"""What every call of a ParallelModule checks of its inputs before it runs (`check_inputs`), and how
the inputs are named in its errors; and the state_dict of a rank's blocks, which warns when pickled by
torch.save."""

from __future__ import annotations

import collections
import hashlib
import os
import sys
import warnings

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from autopar.errors import CheckpointWarning, UsageError
from autopar.program.build import Compiled
from autopar.program.consensus import all_gather_objects
from autopar.program.guards import bit_sum, fingerprint, position_checksum
from passes import Grid
from passes.compat import is_fake, pytree, real_tensors
from passes.ops import comm
from passes.ops.verdicts import VERDICTS

__all__ = ["RankStateDict", "check_inputs", "input_names"]


class RankStateDict(collections.OrderedDict):
    """A ParallelModule's state_dict (this rank's blocks). torch.save of it warns: the file holds one
    rank's blocks as DTensors, which the unmodified model cannot load and which need the same process
    group to unpickle. It pickles as a plain OrderedDict."""

    @staticmethod
    def of(out):
        """nn.Module.state_dict's result as a RankStateDict (its `_metadata` kept); a `destination` the
        caller passed stays what it is."""
        if type(out) is not collections.OrderedDict:
            return out
        blocks = RankStateDict(out)
        if hasattr(out, "_metadata"):
            blocks._metadata = out._metadata  # type: ignore[attr-defined]
        return blocks

    def __reduce_ex__(self, protocol):
        if called_from_torch_save():
            warnings.warn(
                "torch.save(pmodel.state_dict()) writes this rank's parameter blocks only (DTensors that load "
                "only into the same grid, under a process group). For full tensors that the unmodified model "
                "loads: autopar.save_pretrained(pmodel, directory) on every rank, then "
                "model.load_state_dict(autopar.load_full_state_dict(directory)) on one process; for a sharded "
                "checkpoint to resume from: autopar.save_distributed(pmodel, path, optimizer)",
                CheckpointWarning, stacklevel=3)
        state = {k: v for k, v in vars(self).items()}
        return collections.OrderedDict, (), state or None, None, iter(self.items())


def called_from_torch_save() -> bool:
    """Whether torch.save (torch/serialization.py) is pickling: copy.deepcopy and other picklers do not warn."""
    frame = sys._getframe(2)
    for _ in range(12):
        if frame is None:
            return False
        if frame.f_code.co_filename.endswith(os.path.join("torch", "serialization.py")):
            return True
        frame = frame.f_back
    return False


def plain(v):
    """What the input check compares of a non-tensor input: a plain value itself, another object its type
    (its repr may hold an address that differs between processes)."""
    return repr(v) if v is None or isinstance(v, (bool, int, float, str)) else type(v).__name__


def input_names(comp: Compiled, args, kwargs) -> list[str]:
    """The user's name of each flattened input, in placeholder order: "positional input 0",
    "input 'labels'", "positional input 1[0]" for a nested one."""
    spec_kwargs = comp.captured.in_spec.child(1).context if comp.captured.in_spec.num_children == 2 else []
    leaves, _ = pytree.tree_flatten_with_path((tuple(args), {k: kwargs[k] for k in spec_kwargs if k in kwargs}))
    names = []
    for path, _ in leaves:
        head, key, rest = path[0], path[1], "".join(str(k) for k in path[2:])
        names.append(f"positional input {key.idx}{rest}" if head.idx == 0 else f"input {key.key!r}{rest}")
    return names


def check_inputs(grid: Grid, flat: list, device, names, options) -> None:
    """The inputs of one call: on this rank's device, and the same on every rank of the grid (shapes and
    dtypes always; values too with the check_inputs option). `names()`: the user's name of each input,
    for the errors. First the verdicts the previous call left to be read (the `checks` option:
    `passes.ops.verdicts`) are read, raising the error of one that failed."""
    VERDICTS.mode = options.checks
    VERDICTS.poll()
    for i, t in enumerate(flat):
        if isinstance(t, torch.Tensor) and t.device != device:
            raise UsageError(
                f"{names()[i]} (shape {tuple(t.shape)}) is on {t.device}, but this rank's parameter blocks are "
                f"on {device}; pass every input on {device} (the model was parallelized with inputs there)"
            )
    _same_everywhere(grid, flat, device, names, options.check_inputs)


def _same_everywhere(grid: Grid, flat: list, device, names, values_too: bool) -> None:
    """Every rank of a grid must pass the same inputs: a rank with another batch size would abort
    the collectives (gloo: 'Received data size doesn't match'), and one with the same shapes but
    its own batch (as under DDP) would train on a mix of batches with nobody told. One all-reduce
    of four int64 per call (the max of a digest of the shapes and dtypes, of a checksum of the
    values on the device, and of their negations: equal maxima of both signs mean every rank
    had the same); only when they differ are the inputs gathered, to name what differs and where.
    check_inputs=False leaves out the values, never the shapes; so does a dry run's step on fake
    inputs (values it does not have), whose exchange is made of real tensors beside it."""
    if any(is_fake(t) for t in flat):
        with real_tensors():  # inputs the size of one batch of ids: their shapes, as real tensors
            stand_ins = [torch.empty(t.shape, dtype=t.dtype, device=device) if is_fake(t) else t for t in flat]
            return _same_everywhere(grid, stand_ins, device, names, False)
    shapes = [(tuple(t.shape), str(t.dtype)) if isinstance(t, torch.Tensor) else plain(t) for t in flat]
    digest = int.from_bytes(hashlib.sha256(repr(shapes).encode()).digest()[:7], "little")
    values = torch.zeros((), dtype=torch.int64, device=device)
    if values_too:
        for i, t in enumerate(flat):
            if isinstance(t, torch.Tensor):
                values = values + position_checksum(t) * (2 * i + 3)
    both = torch.stack([torch.tensor(digest, dtype=torch.int64, device=device), values])
    both = torch.cat([both, -both])
    mine = both.clone()
    with comm.guarded(grid, "check_inputs all-reduce", "grid", "check_inputs"):
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=grid.world_group)
    if not VERDICTS.now(device):  # read at the next call: the inputs are gone by then, so no names
        return VERDICTS.check(torch.cat([mine, both]), lambda v: v[:4] == v[4:], lambda v: UsageError(
            f"check_inputs: the ranks of this grid were passed different inputs "
            f"({'values' if v[0] == v[4] and v[2] == v[6] else 'shapes or dtypes'}): every rank of a grid computes "
            f"on the same batch; pass the same inputs on all {grid.world} ranks. Run with checks='now' to "
            f"have the call itself name the input and the ranks"))
    got = torch.cat([mine, both]).tolist()  # one read of both: this rank's and the grid's maxima
    mine, agreed = got[:4], got[4:]
    if agreed == mine:
        return
    base = grid.base
    if agreed[0] == mine[0] and agreed[2] == mine[2]:  # same shapes: the values differ
        prints = [fingerprint(t) for t in flat]
        everyone = all_gather_objects(prints, grid.world_group,
                                      comm.guarded(grid, "check_inputs all-gather", "grid", "check_inputs"))
        i = next(i for i in range(len(flat)) if any(e[i] != everyone[0][i] for e in everyone))
        differ = [base + r for r, e in enumerate(everyone) if e[i] != everyone[0][i]]
        raise UsageError(
            f"check_inputs: {names()[i]} differs between the ranks of this grid: ranks {differ} got other "
            f"values than rank {base}. Every rank of a grid computes on the same batch (unlike DDP, "
            f"where each rank takes its own): pass the same inputs on all {grid.world} ranks of a "
            f"grid (seed their data loaders alike; with data-parallel replicas, split the data per "
            f"replica, grid.batch_index, not per rank). check_inputs=False turns this check off")
    everyone = all_gather_objects(shapes, grid.world_group,
                                  comm.guarded(grid, "input shape gather", "grid", "check_inputs"))
    i = next(i for i in range(len(shapes)) if any(e[i] != everyone[0][i] for e in everyone))
    differ = {base + r: e[i] for r, e in enumerate(everyone) if e[i] != everyone[0][i]}
    raise UsageError(
        f"{names()[i]} has shape and dtype {everyone[0][i]} on rank {base} but {differ} on others: every rank "
        f"of a grid must pass the same full inputs (the same batch; check_inputs=False skips comparing "
        f"their values, never their shapes)")


def same_state_everywhere(grid: Grid, state_dict, own, tied: dict) -> None:
    """`ParallelModule.load_state_dict`'s check. Each rank keeps its block of a full tensor, so ranks given
    different values would load a patchwork of them: one all-gather of a checksum per full tensor (its
    shape, dtype and the int64 sum of its bits, read at memory speed) refuses that, naming the first
    tensor and the ranks. `own`: the model's state_dict; `tied`: other name -> registered name."""
    mine = {}
    for name, value in state_dict.items():
        if isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and \
                isinstance(own.get(tied.get(name, name)), DTensor):
            mine[name] = (tuple(value.shape), str(value.dtype), bit_sum(value))
    everyone = all_gather_objects(mine, grid.world_group,
                                  comm.guarded(grid, "load_state_dict checksum all-gather", "grid", "load_state_dict"))
    base = grid.base
    for name in sorted(set().union(*everyone)):
        differ = [base + r for r, e in enumerate(everyone) if e.get(name) != everyone[0].get(name)]
        if differ:
            raise UsageError(
                f"load_state_dict: {name!r} differs between ranks of this grid (rank {base} vs ranks "
                f"{differ}): each rank keeps its block of the full tensors it is given, so every rank must "
                f"pass the same state_dict (load it from the same file on every rank)")
