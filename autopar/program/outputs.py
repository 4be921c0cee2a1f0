"""What a ParallelModule returns, and the user's own loss on it.

A split output is an `Output`: a DTensor on the grid's mesh (`.placements`, `.to_local()`,
`.full_tensor()` as usual) that also follows autopar's rule for inputs: a plain tensor is the full
value, the same on every rank. So a loss written for one process runs on it unchanged, and split:

    logits = pm(ids)                                              # Output [b, s, V], S(0)S(2)
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())  # plain tensor, equal on every rank
    loss.backward()

- A plain tensor combined with an Output counts as replicated: each rank uses its block of it (a
  slice, no communication).
- `F.cross_entropy` (and `nn.CrossEntropyLoss`) over [N, V] logits with class-index targets,
  reduction 'mean' or 'sum', any `ignore_index`, runs vocab-parallel like the in-graph loss
  (`passes.ops.modules.VocabParallelCrossEntropy`): the row max, Σexp and target logit all-reduced
  within each grid row, the token sum and count within each column; the logits are never gathered.
  With class weights, label smoothing, probability targets or reduction='none' it runs DTensor's
  implementation, which gathers the vocabulary within each grid row (not the batch).
- Elementwise losses (`mse_loss`, `l1_loss`, `smooth_l1_loss`, `huber_loss`, `binary_cross_entropy`,
  `binary_cross_entropy_with_logits`) run on the blocks; a mean is the global sum over the global count.
- A loss reduced to a number comes back a plain tensor equal on every rank (one all-reduce of a
  scalar), like the loss a model computes in its forward.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from passes.compat import (disable_torch_function_subclass, dtensor_parts, implicit_replication, legacy_reduction,
                           pytree)
from passes.layout import chunk_range
from passes.mesh import Grid
from passes.ops import comm
from passes.ops.modules import VocabParallelCrossEntropy
from autopar.errors import UsageError

__all__ = ["Output", "wrap"]

LOSS_TAG = "user loss"  # CommLog tag of the collectives of a loss computed on outputs


class Output(DTensor):
    """A split output of a ParallelModule: a DTensor whose operations treat plain tensors as replicated
    and whose common losses run split (see the module docstring). `grid` is the autopar Grid."""

    grid: Grid

    @staticmethod
    def _of(dt: DTensor, grid: Grid) -> "Output":
        out = Output(*dtensor_parts(dt), requires_grad=dt.requires_grad)
        out.grid = grid
        return out

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        loss = _LOSSES.get(func)
        if loss is not None:
            return loss(func, args, kwargs)
        args, kwargs = _replicated(args, kwargs)
        with disable_torch_function_subclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        grid = next(a.grid for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, Output))
        with implicit_replication():
            result = super().__torch_dispatch__(func, types, args, kwargs)
        inputs = {id(a) for a in pytree.tree_leaves((args, kwargs))}
        return pytree.tree_map_only(DTensor, lambda r: r if id(r) in inputs else cls._of(r, grid), result)


def _replicated(args, kwargs):
    """Plain tensors among an Output's operands as replicated DTensors (no copy, no communication),
    before autograd saves them: the backward then meets DTensors only."""
    mesh = next(a.device_mesh for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, Output))

    def lift(t):
        if isinstance(t, DTensor) or t.dim() == 0:
            return t
        return DTensor.from_local(t, mesh, [Replicate()] * mesh.ndim, run_check=False)

    return pytree.tree_map_only(torch.Tensor, lift, (args, kwargs))


class _AsOutput(torch.autograd.Function):
    """The same DTensor, as an Output (gradient passed through)."""

    @staticmethod
    def forward(ctx, dt, grid):
        return Output._of(dt, grid)

    @staticmethod
    def backward(ctx, g):
        return g, None


def wrap(local: torch.Tensor, grid: Grid, placements, shape) -> Output:
    """This rank's block `local` of a program output of global `shape`, as an Output."""
    stride = torch.empty(shape, device="meta").stride()
    dt = DTensor.from_local(local, grid.mesh, list(placements), run_check=False, shape=torch.Size(shape),
                            stride=stride)
    return _AsOutput.apply(dt, grid)


class _SumOverAxes(torch.autograd.Function):
    """The sum of the members' partial values over the given mesh axes (each member's gradient is the
    incoming one: d(sum)/d(part) = 1)."""

    @staticmethod
    def forward(ctx, part, grid, axes):
        for axis in axes:
            part = comm.all_reduce(grid, axis, part, LOSS_TAG, "fwd")
        return part

    @staticmethod
    def backward(ctx, g):
        return g, None, None


def _scalar(t, grid: Grid):
    """A reduced loss as a plain tensor equal on every rank: a partial sum is all-reduced over its
    axes (bytes counted in grid.log under LOSS_TAG)."""
    if not isinstance(t, DTensor):
        return t
    if not all(p.is_replicate() or (isinstance(p, Partial) and p.reduce_op == "sum") for p in t.placements):
        return t.full_tensor()
    local = t.to_local(grad_placements=[Replicate()] * t.device_mesh.ndim)
    return _SumOverAxes.apply(local, grid, [i for i, p in enumerate(t.placements) if isinstance(p, Partial)])


def _grid(bound) -> Grid:
    return next(a.grid for a in bound.arguments.values() if isinstance(a, Output))


def _reduction_of(bound) -> str:
    args = bound.arguments
    if args.get("size_average") is not None or args.get("reduce") is not None:
        return legacy_reduction(args.get("size_average"), args.get("reduce"))
    return args.get("reduction", "mean")


def _bind(func, args, kwargs):
    bound = inspect.signature(func).bind(*args, **kwargs)
    reduction = _reduction_of(bound)
    bound.arguments.pop("size_average", None)
    bound.arguments.pop("reduce", None)
    return bound, reduction


def _call(func, bound, **over):
    args, kwargs = _replicated((), {**bound.arguments, **over})
    with disable_torch_function_subclass():
        return func(**kwargs)


def _elementwise(func, args, kwargs):
    """An elementwise loss on the blocks; a mean is the global sum over the global element count (a
    mean of the blocks' means would weigh uneven blocks wrongly)."""
    bound, reduction = _bind(func, args, kwargs)
    if reduction == "none":
        return _call(func, bound, reduction="none")
    total = _scalar(_call(func, bound, reduction="sum"), _grid(bound))
    if reduction == "sum":
        return total
    shape = torch.broadcast_shapes(bound.arguments["input"].shape, bound.arguments["target"].shape)
    return total / shape.numel()


def _cross_entropy(func, args, kwargs):
    bound, reduction = _bind(func, args, kwargs)
    a = bound.arguments
    logits, target = a["input"], a["target"]
    ignore_index = a.get("ignore_index", -100)
    if _vocab_parallel_fits(logits, target, a, reduction):
        return _vocab_parallel(logits, target, ignore_index, reduction)
    if reduction != "mean":
        out = _call(func, bound, reduction=reduction)
        return _scalar(out, logits.grid) if reduction == "sum" else out
    # DTensor averages the blocks' means, wrong when blocks hold different numbers of counted tokens:
    # sum the tokens' losses and divide by what torch divides by, the total weight of counted targets
    total = _scalar(_call(func, bound, reduction="sum"), logits.grid)
    return total / _target_weight(_full(target), a.get("weight"), ignore_index, logits)


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _target_weight(target, weight, ignore_index, logits):
    """What a mean cross-entropy divides by: the count of targets not ignored (class weights: their
    total weight; probability targets: the number of rows)."""
    if target.is_floating_point():
        return logits.shape[0] if logits.dim() > 1 else 1
    valid = target != ignore_index
    if weight is None:
        return valid.sum()
    return _full(weight)[target.clamp(min=0)].masked_fill(~valid, 0).sum()


def _vocab_parallel_fits(logits, target, a, reduction) -> bool:
    """Whether the in-graph vocab-parallel kernel computes this call: [N, V] logits whose rows are
    split over mesh axis 0 (or whole) and vocabulary split over axis 1 (torch.chunk blocks, or whole),
    class-index targets, no class weights, no label smoothing, a reduced loss."""
    if reduction not in ("mean", "sum") or a.get("weight") is not None or a.get("label_smoothing", 0.0):
        return False
    if logits.dim() != 2 or target.dim() != 1 or target.is_floating_point():
        return False
    rows, vocab = logits.placements
    return rows in (Shard(0), Replicate()) and vocab in (Shard(1), Replicate())


def _vocab_parallel(logits: Output, target, ignore_index: int, reduction: str) -> torch.Tensor:
    """Cross-entropy of [N, V] logits with the in-graph kernel, on this rank's rows and vocabulary
    block; the targets are sliced to the same rows. Logits whole over the rows are cut to this rank's
    row block (their gradient is then a partial sum over the rows, which DTensor reduces)."""
    grid = logits.grid
    rows, vocab = logits.placements
    n, num_classes = logits.shape
    target = _full(target)
    bad = ((target < 0) | (target >= num_classes)) & (target != ignore_index)
    if bool(bad.any()):
        raise UsageError(
            f"cross_entropy: target {int(target[bad][0])} is outside the {num_classes} classes of the logits "
            f"(and is not ignore_index={ignore_index}); targets must be class indices in [0, {num_classes})"
        )
    lo, hi = chunk_range(n, grid.shape[0], grid.r)
    if rows == Replicate():
        local = logits.to_local(grad_placements=[Partial(), vocab])[lo:hi]  # [n/R, V/C]
    else:
        local = logits.to_local()  # [n/R, V/C]
    kernel = VocabParallelCrossEntropy(grid, ignore_index, LOSS_TAG, vocab_split=vocab != Replicate(),
                                       reduce_sum=reduction == "sum", vocab=num_classes)
    return kernel(local, target[lo:hi].to(local.device))


_LOSSES = {F.cross_entropy: _cross_entropy}
_LOSSES.update({f: _elementwise for f in (F.mse_loss, F.l1_loss, F.smooth_l1_loss, F.huber_loss,
                                          F.binary_cross_entropy, F.binary_cross_entropy_with_logits)})
