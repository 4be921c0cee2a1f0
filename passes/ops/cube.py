"""3D tensor parallelism's linear on a q x q x q cube (`passes.mesh.Cube`): the depth algorithm.

An activation X [M, K] is held as blocks [M/q, K/q^2]: rows over r, columns over (c, l), c outer,
which is the 2D layout of the grid (q, q^2) (`Cube.grid`). A weight W [K, N] (math layout) is held as
W[K_(r,l), N_c]: its rows over (r, l), r outer, its columns over c; each rank holds 1/q^3 of both.
Depth l runs the SUMMA product (`passes.ops.summa`) of its slice of the contracted dim, X_l =
X[:, K_(.,l)] times W_l = W[K_(.,l), :], on its q x q grid (`Cube.depth`): a partial sum of Y's block
[M/q, N/q] at (r, c). A reduce-scatter over the depth group sums the q partial sums and splits the
columns, leaving Y [M/q, N/q^2] in X's own layout (N over (c, l)), so the next linear takes it as it
is. Backward: the reduce-scatter's adjoint all-gathers dY over the depth; SUMMA's backward gives dX
(ABT) and dW (ATB), each in its operand's layout.

Bytes received per rank (`passes.cost.cube.cube_linear_bytes`): forward (q-1)(MK + KN + MN)/q^3
elements, backward (q-1)(2MK + 2KN + MN)/q^3: the 1/p^(2/3) volume of 3D matrix multiplication,
against 1/p^(1/2) for SUMMA on a square grid of the same p devices.
"""

from __future__ import annotations

import math

import torch

from passes.compat import all_gather_single, reduce_scatter_single
from passes.cost.volumes import all_gather_bytes, reduce_scatter_bytes
from passes.errors import UsageError
from passes.mesh import Cube
from passes.ops.comm import guarded, tensor_bytes
from passes.ops.summa import SummaAB

__all__ = ["cube_linear", "activation_block", "weight_block", "DepthScatter", "CubeLinear", "run_depth_reduce_scatter",
           "run_depth_all_gather"]


def run_depth_reduce_scatter(cube: Cube, t: torch.Tensor, tag: str) -> torch.Tensor:
    """Sum `t` [m, n] over the depth group and keep this member's column block [m, n/q]: the body of
    the traceable `autopar::depth_reduce_scatter` (`passes.ops.library`)."""
    moved = t.t().contiguous()  # [n, m]: the split dim first
    out = moved.new_empty(moved.shape[0] // cube.q, moved.shape[1])
    cube.log.add(tag, "fwd", reduce_scatter_bytes(tensor_bytes(moved), cube.q))
    cube.log.launch(tag, "fwd")
    with guarded(cube.grid, "reduce-scatter", "depth", tag):
        reduce_scatter_single(out, moved, group=cube.depth_group)
    return out.t().contiguous()


def run_depth_all_gather(cube: Cube, t: torch.Tensor, tag: str) -> torch.Tensor:
    """Concatenate the depth group's column blocks of `t` [m, n/q] into [m, n]: the body of
    `autopar::depth_all_gather`."""
    moved = t.t().contiguous()
    out = moved.new_empty(moved.shape[0] * cube.q, moved.shape[1])
    cube.log.add(tag, "bwd", all_gather_bytes(tensor_bytes(moved), cube.q))
    cube.log.launch(tag, "bwd")
    with guarded(cube.grid, "all-gather", "depth", tag):
        all_gather_single(out, moved, group=cube.depth_group)
    return out.t().contiguous()


class DepthScatter(torch.autograd.Function):
    """Partial sums over the depth -> this member's column block: reduce-scatter forward, all-gather
    backward."""

    @staticmethod
    def forward(ctx, y, cube, tag):
        ctx.args = (cube, tag)
        return torch.ops.autopar.depth_reduce_scatter(y, cube.grid.key, tag) if cube.q > 1 else y

    @staticmethod
    def backward(ctx, g):
        cube, tag = ctx.args
        return (torch.ops.autopar.depth_all_gather(g.contiguous(), cube.grid.key, tag) if cube.q > 1 else g), None, None


def _check(cube: Cube, x: torch.Tensor, w: torch.Tensor, tag: str) -> None:
    q = cube.q
    K, N = w.shape[0] * q * q, w.shape[1] * q
    if x.shape[-1] * q * q != K:
        raise UsageError(f"{tag}: the input block has {x.shape[-1]} columns and the weight block {w.shape[0]} rows; "
                         f"on a {q}x{q}x{q} cube both are K/{q * q} of the contracted dim. Pass the blocks of "
                         f"`activation_block` and `weight_block`")
    if N % (q * q):
        raise UsageError(f"{tag}: the output dim N={N} is not divisible by {q * q} (q^2 on a {q}x{q}x{q} cube): "
                         f"its blocks would be uneven, which the 3D linear does not split; pick sizes divisible by "
                         f"{q * q} or a 2D grid")


def cube_linear(cube: Cube, x: torch.Tensor, w: torch.Tensor, tag: str, *, lowering: str) -> torch.Tensor:
    """x [..., K/q^2] (this rank's block: its rows of the flattened leading dims, columns K_(c,l)) times
    this rank's weight block w [K/q^2, N/q] = W[K_(r,l), N_c] -> y [..., N/q^2], in x's layout; the depth
    products in `lowering` ('broadcast', 'allgather' or 'ring', as `passes.ops.summa`'s)."""
    _check(cube, x, w, tag)
    lead = x.shape[:-1]
    y = SummaAB.apply(x.reshape(math.prod(lead), x.shape[-1]), w, cube.depth, tag, lowering)  # [m, N/q]
    return DepthScatter.apply(y, cube, tag).view(*lead, -1)


def activation_block(cube: Cube, t: torch.Tensor) -> torch.Tensor:
    """This rank's block of a whole activation t [M, K]: rows block r of q, columns block c*q + l of q^2."""
    q = cube.q
    return t.chunk(q, 0)[cube.r].chunk(q * q, 1)[cube.c * q + cube.l].contiguous()


def weight_block(cube: Cube, w: torch.Tensor) -> torch.Tensor:
    """This rank's block of a whole weight w [K, N] (math layout): rows block r*q + l of q^2, columns
    block c of q."""
    q = cube.q
    return w.chunk(q * q, 0)[cube.r * q + cube.l].chunk(q, 1)[cube.c].contiguous()


class CubeLinear(torch.nn.Module):
    """y = x W (+ b) by `cube_linear` on the grid's cube (`Grid.cube`); `flip`: the stored block is
    [N/q, K/q^2] (an nn.Linear's [N, K] weight) and is transposed first."""

    def __init__(self, grid, flip: bool, tag: str, lowering: str):
        super().__init__()
        self.grid, self.flip, self.tag, self.lowering = grid, flip, tag, lowering

    def forward(self, x, w, b=None):
        cube = self.grid.cube
        if cube is None:
            raise UsageError(f"{self.tag}: a 3D linear runs on a cube's grid (strategy='3d', grid=(q, q, q)); "
                             f"this grid {self.grid} has none")
        y = cube_linear(cube, x, w.t() if self.flip else w, self.tag, lowering=self.lowering)
        return y if b is None else y + b.to(y.dtype)

    def extra_repr(self) -> str:
        return f"3D, lowering={self.lowering}"
