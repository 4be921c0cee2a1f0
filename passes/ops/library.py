"""autopar's collectives and SUMMA products as torch.library ops, so torch.compile traces through them.

Dynamo cannot trace a call into `torch.distributed` with a process group object, so each collective
`passes.ops.comm` runs (and each whole SUMMA product of `passes.ops.summa`, which overlaps its own
broadcasts with its matmuls) is registered here as an opaque op of the `autopar` namespace with a
fake kernel that gives its output's shape. The compiled graph calls the op; the op's body is the
eager code, which runs the collective and counts its bytes and launch in `Grid.log` on every call,
compiled or not. A grid travels as its `Grid.key` (op arguments are tensors and plain values).
Gradients stay with the autograd Functions that call these ops: dynamo traces those, and their
backward calls the ops too. Every op returns a new tensor (never a view of an input), as
torch.library requires.

Every op here is declared ORDERED-effectful (`passes.compat.register_ordered`): a compiled program
keeps every call, even one whose result nobody reads, and AOTAutograd threads a token through them
in program order. Ranks whose graphs differ (uneven blocks, rank-specific shapes) compile different
programs; each must still launch its collectives in the program's order, or the ranks wait on one
another for ever. torch 2.13's inductor files the order edges between such ops where its scheduler
never looks (`passes.compat.keep_effect_order_in_inductor`, installed below, files them where it does).

>>> import torch
>>> from passes.mesh import Grid
>>> g = Grid.for_planning(2, 4)
>>> from passes.compat import fake_tensor_mode
>>> with fake_tensor_mode():  # a [m, K/C], b [N/R, K/C] -> [m, N/C]: shapes only, nothing sent
...     a, b = torch.empty(6, 3), torch.empty(5, 3)
...     torch.ops.autopar.summa(a, b, g.key, "abt", "tag", "fwd", "broadcast", False).shape
torch.Size([6, 2])
"""

from __future__ import annotations

from typing import Optional

import torch

from passes.compat import CACHEABLE_EFFECTS, keep_effect_order_in_inductor, register_ordered
from passes.layout import chunk_range
from passes.mesh import Cube, grid_of
from passes.ops import bounds, comm, cube, reblock, summa


@torch.library.custom_op("autopar::all_gather", mutates_args=())
def all_gather(t: torch.Tensor, grid: int, axis: int, dim: int, tag: str, phase: str) -> torch.Tensor:
    return comm.run_all_gather(grid_of(grid), axis, t, dim, tag, phase)


@all_gather.register_fake
def _(t, grid, axis, dim, tag, phase):
    shape = list(t.shape)
    shape[dim] *= grid_of(grid).size(axis)
    return t.new_empty(shape)


@torch.library.custom_op("autopar::reduce_scatter", mutates_args=())
def reduce_scatter(t: torch.Tensor, grid: int, axis: int, dim: int, tag: str, phase: str) -> torch.Tensor:
    return comm.run_reduce_scatter(grid_of(grid), axis, t, dim, tag, phase)


@reduce_scatter.register_fake
def _(t, grid, axis, dim, tag, phase):
    shape = list(t.shape)
    shape[dim] //= grid_of(grid).size(axis)
    return t.new_empty(shape)


@torch.library.custom_op("autopar::all_reduce", mutates_args=())
def all_reduce(t: torch.Tensor, grid: int, axis: int, tag: str, phase: str, op: str) -> torch.Tensor:
    return comm.run_all_reduce(grid_of(grid), axis, t, tag, phase, op)


@all_reduce.register_fake
def _(t, grid, axis, tag, phase, op):
    return torch.empty_like(t, memory_format=torch.contiguous_format)


@torch.library.custom_op("autopar::all_reduce_stack", mutates_args=())
def all_reduce_stack(parts: list[torch.Tensor], grid: int, axis: int, tag: str, phase: str) -> torch.Tensor:
    return comm.run_all_reduce_stack(grid_of(grid), axis, parts, tag, phase)


@all_reduce_stack.register_fake
def _(parts, grid, axis, tag, phase):
    return parts[0].new_empty((len(parts), *parts[0].shape))


@torch.library.custom_op("autopar::summa", mutates_args=())
def product(a: torch.Tensor, b: torch.Tensor, grid: int, kind: str, tag: str, phase: str, lowering: str,
            rows_whole: bool, full: Optional[int] = None) -> torch.Tensor:
    """One SUMMA product `kind` ('ab', 'abt' or 'atb') of the local blocks a, b (see `passes.ops.summa`);
    `full`: the global size of the dim the grid does not divide (torch.chunk blocks)."""
    g = grid_of(grid)
    if kind == "atb":
        return summa.atb(g, a, b, tag, phase, lowering=lowering, rows_whole=rows_whole, full=full)
    product = summa.abt if kind == "abt" else summa.ab
    return product(g, a, b, tag, phase, lowering=lowering, full=full)


@product.register_fake
def _(a, b, grid, kind, tag, phase, lowering, rows_whole, full=None):
    return a.new_empty(summa_shape(grid_of(grid), kind, a, b, full))


def summa_shape(g, kind: str, a, b, full: int | None) -> tuple:
    """The shape of SUMMA product `kind` of the local blocks a, b on this rank of grid `g`."""
    R, C = g.shape

    def block(n: int, parts: int, axis: int) -> int:  # this rank's torch.chunk block of n
        lo, hi = chunk_range(n, parts, g.index(axis))
        return hi - lo

    if kind == "ab":  # a [m, K/C]  b [K/R, n]
        return (a.shape[0], b.shape[1])
    if kind == "abt":  # a [m, K/C]  b [N/R, K/C]  ->  [m, N/C]
        return (a.shape[0], b.shape[0] * R // C if full is None else block(full, C, summa.AXIS_SAME_ROW))
    # atb: a [m, K/C]  b [m, n]  ->  [K/R, n]
    return (a.shape[1] * C // R if full is None else block(full, R, summa.AXIS_SAME_COL), b.shape[1])


@torch.library.custom_op("autopar::reblock", mutates_args=())
def reblocked(t: torch.Tensor, grid: int, axis: int, dim: int, src: list[int], dst: list[int], tag: str,
              phase: str) -> torch.Tensor:
    """Dim `dim` moved from blocking `src` to blocking `dst` over mesh `axis` (`passes.ops.reblock`)."""
    return reblock.run_reblock(grid_of(grid), axis, t, dim, src, dst, tag, phase)


@reblocked.register_fake
def _(t, grid, axis, dim, src, dst, tag, phase):
    i = grid_of(grid).index(axis)
    shape = list(t.shape)
    shape[dim] = dst[i + 1] - dst[i]
    return t.new_empty(shape)


@torch.library.custom_op("autopar::regroup", mutates_args=())
def regrouped(t: torch.Tensor, grid: int, axis: int, dim: int, parts: int, inverse: bool, tag: str,
              phase: str) -> torch.Tensor:
    """Dim `dim` moved between plain and interleaved blocks over mesh `axis` (`passes.ops.reblock`)."""
    return reblock.run_regroup(grid_of(grid), axis, t, dim, parts, inverse, tag, phase)


@regrouped.register_fake
def _(t, grid, axis, dim, parts, inverse, tag, phase):
    return t.new_empty(t.shape)


@torch.library.custom_op("autopar::check_ids", mutates_args=())
def check_ids(ids: torch.Tensor, size: int, where: str) -> torch.Tensor:
    """Raise unless every id lies in [0, size) (`passes.ops.bounds`); returns an empty tensor."""
    bounds.check_ids(ids, size, where)
    return ids.new_empty(0)


@check_ids.register_fake
def _(ids, size, where):
    return ids.new_empty(0)


@torch.library.custom_op("autopar::check_targets", mutates_args=())
def check_targets(target: torch.Tensor, tot: torch.Tensor, grid: int, axis: int, size: int, ignore: int, tag: str,
                  where: str) -> torch.Tensor:
    """Raise on every rank when tot[2], the out-of-range targets counted over mesh `axis` (-1: this
    rank's alone), is not zero (`passes.ops.bounds`); returns an empty tensor."""
    bounds.check_targets(grid_of(grid), axis, target, size, ignore, tot[2], tag, where)
    return target.new_empty(0)


@check_targets.register_fake
def _(target, tot, grid, axis, size, ignore, tag, where):
    return target.new_empty(0)


def _cube_of(key: int) -> Cube:
    """The cube attached to the grid whose key is `key` (a 3D linear's grid always has one)."""
    got = grid_of(key).cube
    assert got is not None, f"grid {key} has no cube: a 3D linear runs on a cube's grid"
    return got


@torch.library.custom_op("autopar::depth_reduce_scatter", mutates_args=())
def depth_reduce_scatter(t: torch.Tensor, grid: int, tag: str) -> torch.Tensor:
    """A 3D linear's partial sums [m, n] summed over the depth of the cube attached to `grid`, this
    member's column block [m, n/q] kept (`passes.ops.cube`)."""
    return cube.run_depth_reduce_scatter(_cube_of(grid), t, tag)


@depth_reduce_scatter.register_fake
def _(t, grid, tag):
    return t.new_empty(t.shape[0], t.shape[1] // _cube_of(grid).q)


@torch.library.custom_op("autopar::depth_all_gather", mutates_args=())
def depth_all_gather(t: torch.Tensor, grid: int, tag: str) -> torch.Tensor:
    """The depth's column blocks [m, n/q] concatenated into [m, n] (the reduce-scatter's adjoint)."""
    return cube.run_depth_all_gather(_cube_of(grid), t, tag)


@depth_all_gather.register_fake
def _(t, grid, tag):
    return t.new_empty(t.shape[0], t.shape[1] * _cube_of(grid).q)


for _name in ("all_gather", "reduce_scatter", "all_reduce", "all_reduce_stack", "summa", "reblock", "regroup",
              "check_ids", "check_targets", "depth_reduce_scatter", "depth_all_gather"):
    register_ordered(f"autopar::{_name}")
keep_effect_order_in_inductor()  # inductor 2.13 loses the order edges between them otherwise

# what compile=True passes to torch.compile: graphs calling these ops may be kept by inductor's FX graph cache
INDUCTOR_OPTIONS = {"unsafe_marked_cacheable_functions": CACHEABLE_EFFECTS}
