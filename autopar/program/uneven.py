"""Splits of dims the grid does not divide: which tensors have them and what they cost.

With `indivisible="uneven"` (the default) such a dim is cut in torch.chunk blocks, as DTensor's
`Shard` cuts it: ceil(n/q) elements per member, the last blocks shorter (or empty). Nothing is
padded in memory or on disk, so the cost is the imbalance: the rank holding the largest block holds
more than an even share n/q, and works on it. `explain` lists each such parameter with its blocks
and that excess, and counts the activations that are split this way.

>>> from torch.distributed.tensor import Shard
>>> from passes.layout import Layout
>>> s = UnevenSplit("tok.weight", (97, 24), Layout((Shard(0), Shard(1))), (2, 2), 4)
>>> s.blocks, s.largest_bytes, s.excess_bytes
('dim 0: 49, 48 over 2 rows', 2352, 24)
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from passes.cost.planned import nodes_needing_grad
from passes.kernels.spec import Site
from passes.layout import Layout, chunk_range, is_uneven, local_shape, split_dim
from passes.meta import KERNEL, LAYOUT

__all__ = ["UnevenSplit", "uneven_params", "uneven_nodes", "summary_lines", "received_by_position",
           "most_received"]
_AXES = ("rows", "columns")


@dataclass(frozen=True)
class UnevenSplit:
    """A tensor of `shape` laid out `layout` on an R x C `mesh`, one of whose split dims the mesh axis
    does not divide; `itemsize`: bytes per element."""

    name: str
    shape: tuple
    layout: Layout
    mesh: tuple
    itemsize: int

    @property
    def blocks(self) -> str:
        """The block sizes of each uneven dim, e.g. 'dim 0: 49, 48 over 2 rows'."""
        out = []
        for axis, p in enumerate(self.layout.normalized(len(self.shape)).placements):
            d, n = split_dim(p), self.mesh[axis]
            if d is not None and self.shape[d] % n:
                sizes = ", ".join(str(hi - lo) for lo, hi in (chunk_range(self.shape[d], n, i) for i in range(n)))
                out.append(f"dim {d}: {sizes} over {n} {_AXES[axis]}")
        return "; ".join(out)

    @property
    def largest_bytes(self) -> int:
        """Bytes of the largest block (grid position (0, 0)'s)."""
        return math.prod(local_shape(self.shape, self.layout, self.mesh, at=(0, 0))) * self.itemsize

    @property
    def excess_bytes(self) -> int:
        """What the largest block holds above an even share of the split (a real number of bytes)."""
        even = math.prod(self.shape) * self.itemsize
        for axis, p in enumerate(self.layout.placements):
            if split_dim(p) is not None:
                even /= self.mesh[axis]
        return self.largest_bytes - math.ceil(even)


def uneven_params(pmodel) -> list:
    """An UnevenSplit for each parameter of a ParallelModule split in blocks of unequal sizes."""
    mesh = tuple(pmodel.grid.shape)
    out = []
    layouts = pmodel.param_layouts  # the grid's layout (sharded replicas add a replica axis to placements)
    for name, p in pmodel.named_parameters():
        lay = layouts.get(name)
        if lay is not None and len(lay.placements) == 2 and is_uneven(tuple(p.shape), lay, mesh):
            out.append(UnevenSplit(name, tuple(p.shape), lay, mesh, p.element_size()))
    return out


def uneven_nodes(gm, mesh) -> list:
    """The names of the graph's nodes whose result is split in blocks of unequal sizes."""
    names = []
    for node in gm.graph.nodes:
        lay, val = node.meta.get(LAYOUT), node.meta.get("val")
        if isinstance(lay, Layout) and hasattr(val, "shape") and is_uneven(tuple(val.shape), lay, mesh):
            names.append(node.name)
    return names


def received_by_position(gm, mesh) -> dict:
    """(r, c) -> bytes the rank at that grid position receives in a training step (forward and
    backward), each inserted module of the rewritten graph `gm` priced by its spec at that position,
    in numbers as the estimate counts them (`KernelSpec.steps` with exact=False)."""
    grads = nodes_needing_grad(gm)
    mods = [(n, n.meta[KERNEL]) for n in gm.graph.nodes if n.op == "call_module" and n.meta.get(KERNEL) is not None]
    out = {}
    for at in itertools.product(range(mesh[0]), range(mesh[1])):
        sites = [(spec, Site.inserted(node, mesh, grads, at)) for node, spec in mods]
        out[at] = sum(b for spec, site in sites for _, _, b in spec.steps(site, spec.values(site), exact=False))
    return out


def most_received(gm, mesh, origin: int) -> tuple:
    """(grid position, bytes) of the rank that receives the most in a training step, given `origin`,
    the plan's exact figure for (0, 0): that figure moved by the difference the position's blocks
    make. ((0, 0), origin) when the grid divides every split dim (every rank receives the same)."""
    mesh = tuple(mesh)
    if not uneven_nodes(gm, mesh):
        return (0, 0), origin
    by = received_by_position(gm, mesh)
    at = max(by, key=lambda k: by[k])
    return at, origin + round(by[at] - by[(0, 0)])


def summary_lines(pmodel, received: int | None = None) -> list:
    """explain's footer on uneven splits: one line per parameter, one for the activations, and with
    `received` (the table's total, priced at grid position (0, 0)) the rank that receives the most;
    none when the grid divides every split dim."""
    params = uneven_params(pmodel)
    mesh = tuple(pmodel.grid.shape)
    nodes = uneven_nodes(pmodel.program.gm, mesh)
    if not params and not nodes:
        return []
    lines = [f"uneven splits (torch.chunk blocks, nothing padded): {len(params)} parameter(s), "
             f"{len(nodes)} op result(s)"]
    if received is not None:
        at, most = most_received(pmodel.program.inspected, mesh, received)
        lines.append(f"  bytes received differ by grid position: the table prices (0, 0), {received} B per step; "
                     f"the most, {most} B, at {at}")
    for s in params:
        lines.append(f"  {s.name} {s.shape} {s.layout}: {s.blocks}; largest block "
                     f"{s.largest_bytes} B, {s.excess_bytes} B above an even share")
    return lines
