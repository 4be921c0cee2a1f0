"""Reblocking: move a dim split over one mesh axis from one contiguous blocking to another, sending
each member only the part of its new block that another member holds (one all-to-all).

Attention's q, k and v leave their projection in hidden blocks (torch.chunk blocks of the hidden size
h = heads x head_dim) and attention runs on head blocks (torch.chunk blocks of the heads, head_dim
elements each). When the columns divide the heads the two coincide; when they do not, they differ:
GPT-2-XL's 1600 = 25 x 64 on 8 columns is 8 blocks of 200 against 6 of 256, one of 64 and one empty.
Gathering the whole dim and cutting receives C - 1 blocks per member; reblocking receives at most one
block (less the overlap with the block it already holds), and the reverse move (attention's output
back to hidden blocks for the next projection, and each move's backward) the same.

A blocking is the tuple of its q + 1 boundaries along the dim (`bounds`): member i holds
[bounds[i], bounds[i + 1]).

>>> hidden, heads = bounds(1600, 8), bounds(25, 8, unit=64)
>>> hidden[:3], heads[:3], heads[-3:]
((0, 200, 400), (0, 256, 512), (1536, 1600, 1600))
>>> [received(hidden, heads, i) for i in range(8)]  # elements per row each column receives
[56, 112, 168, 224, 256, 256, 64, 0]
>>> [received(heads, hidden, i) for i in range(8)]  # and moving back
[0, 56, 112, 168, 200, 200, 200, 200]
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from passes.cost.volumes import all_to_all_bytes, regroup_chunks
from passes.layout import chunk_range
from passes.mesh import Grid
from passes.ops import comm

__all__ = ["bounds", "overlap", "received", "reblock", "run_reblock", "Reblock", "ReblockView", "regroup",
           "run_regroup", "Regroup"]


def bounds(n: int, q: int, unit: int = 1) -> tuple:
    """The boundaries of the torch.chunk blocks of `n` units over `q` members, in elements of `unit`."""
    return tuple(chunk_range(n, q, i)[0] * unit for i in range(q)) + (n * unit,)


def overlap(a: Sequence[int], i: int, b: Sequence[int], j: int) -> int:
    """Elements that block i of blocking `a` and block j of blocking `b` share."""
    return max(0, min(a[i + 1], b[j + 1]) - max(a[i], b[j]))


def received(src: Sequence[int], dst: Sequence[int], i: int) -> int:
    """Elements (per index of the other dims) member i receives moving `src` blocks to `dst` blocks:
    its new block less what it already holds."""
    return sum(overlap(src, j, dst, i) for j in range(len(src) - 1) if j != i)


def reblock(grid: Grid, axis: int, t: torch.Tensor, dim: int, src: tuple, dst: tuple, tag: str,
            phase: str) -> torch.Tensor:
    """This member's `dst` block of `dim`, from the members' `src` blocks (traceable: the body runs in
    `passes.ops.library`'s op)."""
    if grid.size(axis) == 1:
        return t.contiguous()
    return torch.ops.autopar.reblock(t, grid.key, axis, dim, list(src), list(dst), tag, phase)


def run_reblock(grid: Grid, axis: int, t: torch.Tensor, dim: int, src: list, dst: list, tag: str,
                phase: str) -> torch.Tensor:
    """`reblock` now, on a group of more than one member: the body of its torch.library op. Blocks
    are contiguous and in member order, so the pieces received, in member order, are the new block."""
    i, q = grid.index(axis), grid.size(axis)
    send = [overlap(src, i, dst, j) for j in range(q)]
    recv = [overlap(src, j, dst, i) for j in range(q)]
    return _exchange(grid, axis, t.movedim(dim, 0).contiguous(), send, recv, tag, phase).movedim(0, dim).contiguous()


def _exchange(grid: Grid, axis: int, moved: torch.Tensor, send: list, recv: list, tag: str, phase: str):
    """One all-to-all over mesh `axis` of the rows of `moved` (its dim 0): send[j] consecutive rows to
    member j, recv[j] received from it, in member order; counted and launched in `grid.log`."""
    out = moved.new_empty((sum(recv),) + tuple(moved.shape[1:]))
    row = math.prod(moved.shape[1:]) * moved.element_size()  # bytes per row (a block may be empty)
    grid.log.add(tag, phase, all_to_all_bytes(recv, grid.index(axis), row))
    grid.log.launch(tag, phase)
    with comm.guarded(grid, "all-to-all", axis, tag):
        dist.all_to_all_single(out, moved, recv, send, group=grid.group(axis))
    return out


class Reblock(torch.autograd.Function):
    """`src` blocks -> `dst` blocks of `dim` over mesh `axis`; backward moves the gradient back."""

    @staticmethod
    def forward(ctx, x, grid, axis, dim, src, dst, tag):
        ctx.args = (grid, axis, dim, src, dst, tag)
        return reblock(grid, axis, x, dim, src, dst, tag, "fwd")

    @staticmethod
    def backward(ctx, g):
        grid, axis, dim, src, dst, tag = ctx.args
        return reblock(grid, axis, g, dim, dst, src, tag, "bwd"), None, None, None, None, None, None


class ReblockView(nn.Module):
    """A view whose split dim changes blocking (hidden blocks <-> head blocks): the local block
    reshaped to `before` (the dims the view merges or splits, as one), reblocked along `dim` from
    `src` to `dst` over mesh `axis`, then reshaped to this rank's block of the view's output, `after`."""

    def __init__(self, grid: Grid, axis: int, dim: int, src: tuple, dst: tuple, before: tuple, after: tuple,
                 tag: str):
        super().__init__()
        self.grid, self.axis, self.dim, self.src, self.dst, self.tag = grid, axis, dim, src, dst, tag
        self.before, self.after = before, after

    def forward(self, x):
        x = Reblock.apply(x.reshape(self.before), self.grid, self.axis, self.dim, self.src, self.dst, self.tag)
        return x.reshape(self.after)

    def extra_repr(self) -> str:
        return f"axis={self.axis}, dim={self.dim}, {list(self.src)} -> {list(self.dst)}"


def _chunk_order(g: int, k: int, me: int) -> list:
    """Member `me`'s plain chunks (0 ... k - 1 locally) in the order of their interleaved destination."""
    return sorted(range(k), key=lambda r: ((me * k + r) % g, r))


def regroup(grid: Grid, axis: int, t: torch.Tensor, dim: int, parts: int, inverse: bool, tag: str,
            phase: str) -> torch.Tensor:
    """This member's interleaved block of `dim` (block i of each of `parts` parts: a fused projection's
    layout) from the members' plain blocks, or with `inverse` the plain block from interleaved ones, in
    one all-to-all of the chunks other members hold (`passes.cost.volumes.regroup_chunks`): what a
    gather of the whole dim and a cut would do, receiving about 1/g of it (traceable)."""
    if grid.size(axis) == 1:
        return t.contiguous()
    return torch.ops.autopar.regroup(t, grid.key, axis, dim, parts, inverse, tag, phase)


def run_regroup(grid: Grid, axis: int, t: torch.Tensor, dim: int, parts: int, inverse: bool, tag: str,
                phase: str) -> torch.Tensor:
    """`regroup` now: the body of its torch.library op."""
    i, q = grid.index(axis), grid.size(axis)
    send, recv = regroup_chunks(q, parts, i, inverse)
    chunks = t.movedim(dim, 0).contiguous().chunk(parts)
    order = _chunk_order(q, parts, i)  # plain chunks leave, and arrive back, in (member, chunk) order
    moved = torch.cat([chunks[r] for r in order]) if not inverse else torch.cat(chunks)
    u = chunks[0].shape[0]  # rows per chunk
    out = _exchange(grid, axis, moved, [c * u for c in send], [c * u for c in recv], tag, phase)
    if inverse:
        got = out.chunk(parts)
        out = torch.cat([got[order.index(r)] for r in range(parts)])
    return out.movedim(0, dim).contiguous()


class Regroup(torch.autograd.Function):
    """Plain blocks of `dim` over mesh `axis` -> interleaved ones of `parts` parts (or back, `inverse`);
    backward moves the gradient the other way."""

    @staticmethod
    def forward(ctx, x, grid, axis, dim, parts, inverse, tag):
        ctx.args = (grid, axis, dim, parts, inverse, tag)
        return regroup(grid, axis, x, dim, parts, inverse, tag, "fwd")

    @staticmethod
    def backward(ctx, g):
        grid, axis, dim, parts, inverse, tag = ctx.args
        return regroup(grid, axis, g, dim, parts, not inverse, tag, "bwd"), None, None, None, None, None, None
