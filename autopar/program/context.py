"""A context-parallel call (`parallelize(..., context_parallel=cp)`): each rank's part of the whole inputs in,
the whole outputs out. Every rank passes the same whole batch, as ranks of one grid do; this cuts the rank's
zig-zag part of the sequence (`passes.ops.context`), computes the extra inputs its program reads (a loss's
shifted targets, from the whole labels: `passes.transforms.context`), and gathers the outputs with a
sequence dim and sums the model's mean loss over the cp ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard

from autopar.errors import UsageError
from autopar.program.guards import position_checksum
from passes.capture.export import flatten_inputs
from passes.compat import is_fake, pytree
from passes.mesh import CP_AXIS, Grid
from passes.ops import comm
from passes.ops.context import LossSum, SeqGather, take
from passes.ops.verdicts import VERDICTS

__all__ = ["check_model", "gather_outputs", "local_call", "local_inputs", "same_batch"]


def _sequence(args, kwargs, cp: int, who: str) -> int:
    first = next((t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.dim() >= 2),
                 None)
    if first is None:
        raise UsageError(f"{who}: context_parallel={cp} splits the sequence (dim 1 of the inputs), but no input has "
                         f"one: pass [batch, sequence, ...] inputs, or context_parallel=1")
    s = first.shape[1]
    if s % (2 * cp):
        raise UsageError(
            f"{who}: context_parallel={cp} cuts each sequence into 2 * cp = {2 * cp} chunks (two per rank, zig-zag, "
            f"so every rank has equal causal work), but the inputs' sequence length is {s}: pad the batch to a "
            f"multiple of {2 * cp} (labels -100 at the padded positions), or pick a cp for which {s} divides by 2 * cp")
    mask = (kwargs or {}).get("attention_mask")
    if isinstance(mask, torch.Tensor):
        raise UsageError(
            f"{who}: attention_mask with context_parallel={cp}: padding masks are not supported by context "
            f"parallelism yet (attention is causal by global position, or unmasked). Pass no attention_mask "
            f"(pack the sequences, or pad at the end with labels -100), or parallelize with context_parallel=1")
    return s


def local_call(grid: Grid, args, kwargs, who: str = "context_parallel") -> tuple:
    """(args, kwargs) with every tensor whose dim 1 is the sequence cut to this rank's part."""
    s = _sequence(args, kwargs, grid.cp, who)

    def cut(t):
        if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[1] == s:
            return take(t, 1, grid.cp_index, grid.cp)
        return t

    args, kwargs = pytree.tree_map(cut, (tuple(args), dict(kwargs or {})))
    return args, kwargs


def same_batch(grid: Grid, full: list, device, values_too: bool) -> None:
    """Every cp rank must pass the same whole batch (each cuts its own part): a checksum of the whole inputs'
    values, its maximum and minimum over the cp ranks, one all-reduce of two int64 (the grid's own check compares
    each grid's parts). A rank that took its own batch, as a data-parallel replica would, is refused; read now or
    at the next call, as the `checks` option says."""
    if not values_too or any(is_fake(t) for t in full):
        return
    values = torch.zeros((), dtype=torch.int64, device=device)
    for i, t in enumerate(full):
        if isinstance(t, torch.Tensor):
            values = values + position_checksum(t) * (2 * i + 3)
    both = torch.stack([values, -values])
    mine = both.clone()
    with comm.guarded(grid, "check_inputs all-reduce", CP_AXIS, "check_inputs"):
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=grid.group(CP_AXIS))

    def error(_):
        return UsageError(
            f"check_inputs: the {grid.cp} context-parallel ranks of this grid position were passed different "
            f"batches: with context_parallel every rank passes the same whole batch (each computes its own part of "
            f"the sequence); with data-parallel replicas beside them (grid=(dp, R, C)) the ranks of one batch share "
            f"`pmodel.grid.batch_index` (split the data by it, not by grid.dp_index). Pass the same inputs on the cp "
            f"ranks of a batch; check_inputs=False turns this check off")

    VERDICTS.check(torch.cat([mine, both]), lambda v: v[:2] == v[2:], error)


def local_inputs(comp, grid: Grid, flat: list, args, kwargs) -> tuple:
    """(this rank's flat inputs with the extra ones its program reads, the whole flat inputs, the extra inputs
    over the whole sequence) of a call whose whole inputs are `args` / `kwargs`."""
    full = flatten_inputs(comp.captured, args, kwargs)
    wholes = comp.captured.context.whole_targets(full)
    return flat + comp.captured.context.extra_inputs(wholes, grid.cp_index), full, wholes


def gather_outputs(comp, grid: Grid, leaves: list, wholes: list) -> tuple:
    """(the output leaves, their (layout, global shape)): the sequence outputs gathered over the cp ranks, the
    model's loss summed over them (weighted by the shares of `wholes`, the whole targets)."""
    plan = comp.captured.context
    leaves, layouts = list(leaves), list(comp.out_layouts)
    for i in plan.seq_outputs:
        lay, shape = layouts[i]
        if any(isinstance(p, Shard) and p.dim == 1 for p in lay.placements):
            raise UsageError(f"context_parallel: output {i} is split along its sequence dim over the grid ({lay}); "
                             f"gathering it over the cp ranks is not supported yet: use strategy='2d'")
        leaves[i] = SeqGather.apply(leaves[i], grid, f"output {i}")
        layouts[i] = (lay, (shape[0], shape[1] * grid.cp) + tuple(shape[2:]))
    if plan.loss is not None:
        leaves[plan.loss] = LossSum.apply(leaves[plan.loss], plan.share(wholes, grid.cp_index), grid)
    return leaves, layouts


def check_model(model, cp: int, who: str) -> None:
    """A transformers model whose attention is windowed or chunked is refused: its mask at 1/cp of the sequence
    can look causal while the whole sequence's is not."""
    config = getattr(model, "config", None)
    window = getattr(config, "sliding_window", None)
    used = getattr(config, "use_sliding_window", True) is not False
    types = getattr(config, "layer_types", None) or ()
    chunk = getattr(config, "attention_chunk_size", None)
    if (window and used and (not types or any("sliding" in str(t) for t in types))) or chunk:
        what = f"sliding_window={window}" if window else f"attention_chunk_size={chunk}"
        raise UsageError(
            f"{who}: context_parallel={cp} with {type(model).__name__}'s {what}: windowed or chunked attention is not "
            f"supported by context parallelism yet. Build the config with sliding_window=None (where the model "
            f"allows), or parallelize with context_parallel=1")
