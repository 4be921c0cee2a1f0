"""Layouts: one placement per mesh axis, using `torch.distributed.tensor` placement types.

A layout is a pair (placement over axis 0, placement over axis 1); it prints compactly, e.g.
`S(0)S(2)` for an activation [b, s, h] split batch over rows and hidden over columns, `RS(0)` for a
bias split over columns, `P(sum)R` for a partial sum over the same-column group.

A fused projection's output (q|k|v side by side in one dim) uses DTensor's `_StridedShard(dim, k)`,
printed `S(2)x3`: the dim is cut into k equal parts and each rank holds its block *of every part*,
so that splitting the local block into k gives this rank's block of q, of k and of v.

>>> from torch.distributed.tensor import Shard, Replicate
>>> lay = Layout((Shard(0), Shard(2)))
>>> lay, local_shape((8, 16, 32), lay, (2, 4))
(S(0)S(2), (4, 16, 8))
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from passes.compat import StridedShard
from passes.errors import ShardingError

__all__ = ["Layout", "Partial", "Replicate", "Shard", "Strided", "REPLICATED", "local_shape", "ShardingError",
           "split_dim", "parts", "moved", "mesh_shape", "chunk_range", "GridShape", "uneven_ok", "is_uneven",
           "cube_sizes"]
Strided = StridedShard


def split_dim(p: Placement) -> int | None:
    """The tensor dim a placement splits (Shard or Strided), else None."""
    return p.dim if isinstance(p, (Shard, Strided)) else None


def parts(p: Placement) -> int:
    """How many interleaved parts a split has: k for Strided(dim, k), 1 for Shard."""
    return p.split_factor if isinstance(p, Strided) else 1


def moved(p: Placement, dim: int) -> Placement:
    """The same kind of split, on another dim."""
    return Strided(dim, split_factor=p.split_factor) if isinstance(p, Strided) else Shard(dim)



def _short(p: Placement) -> str:
    if isinstance(p, Strided):
        return f"S({p.dim})x{p.split_factor}"
    if isinstance(p, Shard):
        return f"S({p.dim})"
    if isinstance(p, Partial):
        return f"P({p.reduce_op})"
    return "R"


@dataclass(frozen=True)
class Layout:
    placements: tuple  # (axis 0, axis 1); a cube weight's: (r, c, l), see `cube_sizes`

    def __post_init__(self):
        dims = [split_dim(p) for p in self.placements[:2] if split_dim(p) is not None]
        assert len(dims) == len(set(dims)), f"two mesh axes shard the same dim: {self}"

    def __repr__(self) -> str:
        return "".join(_short(p) for p in self.placements)

    def __getitem__(self, axis: int) -> Placement:
        return self.placements[axis]

    def with_axis(self, axis: int, p: Placement) -> "Layout":
        ps = list(self.placements)
        ps[axis] = p
        return Layout(tuple(ps))

    def shard_axis(self, dim: int) -> int | None:
        """The mesh axis that shards tensor `dim`, or None."""
        for axis, p in enumerate(self.placements):
            if split_dim(p) == dim:
                return axis
        return None

    @property
    def is_replicated(self) -> bool:
        return all(isinstance(p, Replicate) for p in self.placements)

    @property
    def has_partial(self) -> bool:
        return any(isinstance(p, Partial) for p in self.placements)

    def normalized(self, ndim: int) -> "Layout":
        """Negative shard dims made positive."""
        return Layout(tuple(moved(p, p.dim % ndim) if split_dim(p) is not None else p for p in self.placements))


REPLICATED = Layout((Replicate(), Replicate()))


def mesh_shape(mesh) -> tuple:
    """(R, C) from a grid shape given as (R, C) or as q for a square q x q grid."""
    return (mesh, mesh) if isinstance(mesh, int) else tuple(mesh)


class GridShape(tuple):
    """The grid shape (R, C) as the rules see it, with `uneven`: whether a rule may split a dim that
    the mesh axis does not divide (`Options.indivisible == "uneven"`), in `torch.chunk` blocks."""

    uneven: bool

    def __new__(cls, shape, uneven: bool = False):
        self = super().__new__(cls, mesh_shape(shape))
        self.uneven = uneven
        return self


def uneven_ok(mesh) -> bool:
    """Whether rules may split dims the grid does not divide (a `GridShape` built with uneven=True)."""
    return getattr(mesh, "uneven", False)


def chunk_range(size: int, n: int, index: int) -> tuple:
    """[start, stop) of block `index` when `size` is split `n` ways as torch.chunk and DTensor's Shard
    do: blocks of ceil(size / n), the last ones shorter or empty.

    >>> [chunk_range(7, 3, i) for i in range(3)], chunk_range(5, 4, 3)
    ([(0, 3), (3, 6), (6, 7)], (5, 5))
    """
    block = -(-size // n)
    return min(index * block, size), min((index + 1) * block, size)


def cube_sizes(layout: Layout, mesh) -> tuple:
    """The members of each mesh axis `layout` places over: (R, C) for a grid layout; for a cube weight's
    layout (three placements over the axes r, c, l of a q x q x q cube, whose grid is (q, q*q):
    `passes.mesh.Cube`), (q, q, q). Two of a cube layout's axes may split one dim: r's blocks, then l's
    within each (DTensor's order for mesh dims that shard the same tensor dim).

    >>> cube_sizes(Layout((Shard(1), Shard(0), Shard(1))), (2, 4))
    (2, 2, 2)
    """
    R, C = mesh_shape(mesh)
    if len(layout.placements) == 2:
        return R, C
    assert C == R * R, f"a cube layout {layout} on a grid {(R, C)} that is not (q, q*q)"
    return R, R, R


def _cube_at(layout: Layout, at: tuple | None, mesh) -> tuple | None:
    """A grid position (r, j) as the cube's (r, c, l) for a cube layout; else as it is."""
    if at is None or len(layout.placements) == 2:
        return at
    q = mesh_shape(mesh)[0]
    return at[0], at[1] // q, at[1] % q


def is_uneven(shape, layout: Layout, mesh) -> bool:
    """Whether `layout` splits a dim of `shape` that its mesh axis does not divide."""
    return any(split_dim(p) is not None and shape[p.dim] % (n * parts(p))
               for n, p in zip(cube_sizes(layout, mesh), layout.normalized(len(shape)).placements))


def local_shape(shape, layout: Layout, mesh, what: str = "tensor", at: tuple | None = None) -> tuple:
    """The block shape a rank holds on an R x C mesh (`mesh` = (R, C), or q for q x q). A split dim
    that its mesh axis does not divide raises ShardingError, unless `at` names the rank's grid
    coordinates (r, c): then it is that rank's torch.chunk block (`chunk_range`; (0, 0) holds the
    largest one, the one costs are priced on).

    >>> local_shape((7, 4), Layout((Shard(0), Replicate())), (2, 2), at=(1, 0))
    (3, 4)
    """
    sizes, at = cube_sizes(layout, mesh), _cube_at(layout, at, mesh)
    out = list(shape)
    for axis, p in enumerate(layout.placements):
        if split_dim(p) is not None:
            n = sizes[axis]
            if out[p.dim] % (n * parts(p)) and at is not None and parts(p) == 1:
                lo, hi = chunk_range(out[p.dim], n, at[axis])
                out[p.dim] = hi - lo
                continue
            if out[p.dim] % (n * parts(p)):
                raise ShardingError(
                    f"{what}: dim {p.dim} of shape {tuple(shape)} has size {shape[p.dim]}, which is not "
                    f"divisible by {n * parts(p)} (mesh axis {axis} has {n} members); it cannot be split {layout}."
                )
            out[p.dim] //= n
    return tuple(out)
