"""Convolutions and batch norm on blocks: the batch over the mesh rows, the channels over the columns.

`SplitConv` runs a convolution whose weight may be stored split over the rows too (gathered for the
step by `_GatherRows`) and a grouped one on whole groups per column; `SplitBatchNorm` runs
training-mode batch norm with statistics summed over the rows and the running statistics kept whole.
Their specs (bytes, calls) are `passes.kernels.local.ConvSpec` and `BatchNormSpec`.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from passes.mesh import Grid
from passes.ops import comm
from passes.ops.modules import HALF


class _GatherRows(torch.autograd.Function):
    """A weight block stored split over the mesh rows along `dim`: all-gathered in the column forward,
    its gradient reduce-scattered back backward (the sum over the rows' batch blocks, already split)."""

    @staticmethod
    def forward(ctx, w, grid, dim, tag):
        ctx.args = (grid, dim, tag)
        return comm.all_gather(grid, 0, w, dim, tag, "fwd")

    @staticmethod
    def backward(ctx, g):
        grid, dim, tag = ctx.args
        return comm.reduce_scatter(grid, 0, g, dim, tag, "bwd"), None, None, None


class SplitConv(nn.Module):
    """A convolution with the batch over the mesh rows and the output channels over the columns. A
    grouped one (depthwise included; `groups` is this column's count) holds whole groups per column,
    so its input channels are split alike. With `gathered` the weight block is stored split over the
    rows too (by input channel) and gathered in the column for the step, its gradient reduce-scattered:
    the bytes of the all-reduce a weight whole over the rows would need, 1/(RC) of the weight held."""

    def __init__(self, grid: Grid, dims: int, groups: int, stride, padding, dilation, tag: str, gathered: bool):
        super().__init__()
        self.grid, self.tag, self.gathered = grid, tag, gathered
        self.conv = (F.conv1d, F.conv2d, F.conv3d)[dims - 1]
        self.groups, self.stride, self.padding, self.dilation = groups, stride, padding, dilation

    def forward(self, x, w, b=None):
        w = _GatherRows.apply(w, self.grid, 1, self.tag) if self.gathered else w
        return self.conv(x, w, b, self.stride, self.padding, self.dilation, self.groups)

    def extra_repr(self) -> str:
        return f"groups={self.groups} per column" + (", weight gathered over the rows" if self.gathered else "")


class _BatchNormFn(torch.autograd.Function):
    """Training-mode batch norm of x [N/R, C/q, ...]. With the batch split over the mesh rows (`rows`)
    the per-channel statistics are sums over every row's block, all-reduced in the column (shifted, as
    `_ShardedNormFn`: a first all-reduce gives m0, the second sums x - m0 and its square). The running
    statistics are buffers whole on every rank: with the channels split over the columns (`cols`) the
    new (mean, unbiased variance) of every channel is all-gathered in the row and each rank updates its
    whole buffers in place as torch does. Backward in closed form: with `rows`, one all-reduce of
    (sum dxhat, sum dxhat * xhat) per channel."""

    @staticmethod
    def forward(ctx, x, w, b, running_mean, running_var, grid, momentum, eps, tag, rows, cols):
        acc = torch.float32 if x.dtype in HALF else x.dtype
        xa, dims, shape = x.to(acc), _bn_dims(x), _bn_shape(x)
        n = x.numel() // max(x.shape[1], 1) * (grid.size(0) if rows else 1)  # values per channel, whole batch
        sums = (lambda parts: comm.all_reduce_stack(grid, 0, parts, tag, "fwd")) if rows else torch.stack
        m0 = sums([xa.sum(dims)])[0] / n
        xc = xa - m0.view(shape)
        s1, s2 = sums([xc.sum(dims), (xc * xc).sum(dims)])
        shift = s1 / n
        mean, var = m0 + shift, ((s2 - s1 * shift) / n).clamp_min(0)
        rstd = torch.rsqrt(var + eps)
        if running_mean is not None:
            with torch.no_grad():
                new = torch.stack([mean, var * n / max(n - 1, 1)])  # [2, C/q]
                new = comm.all_gather(grid, 1, new, 1, tag, "fwd") if cols else new  # [2, C]
                running_mean.mul_(1 - momentum).add_(new[0].to(running_mean.dtype), alpha=momentum)
                running_var.mul_(1 - momentum).add_(new[1].to(running_var.dtype), alpha=momentum)
        ctx.save_for_backward(x, w, mean, rstd)
        ctx.args = (grid, n, tag, None if b is None else b.dtype, rows)
        y = (xc - shift.view(shape)) * rstd.view(shape)
        y = y if w is None else y * w.to(acc).view(shape)
        y = y if b is None else y + b.to(acc).view(shape)
        return y.to(x.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        x, w, mean, rstd = ctx.saved_tensors
        grid, n, tag, b_dtype, rows = ctx.args
        acc, dims, shape = rstd.dtype, _bn_dims(x), _bn_shape(x)
        xhat = (x.to(acc) - mean.view(shape)) * rstd.view(shape)
        gy = g.to(acc)
        gx = gy if w is None else gy * w.to(acc).view(shape)
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            parts = [gx.sum(dims), (gx * xhat).sum(dims)]
            s1, s2 = comm.all_reduce_stack(grid, 0, parts, tag, "bwd") if rows else parts
            dx = (rstd.view(shape) * (gx - s1.view(shape) / n - xhat * s2.view(shape) / n)).to(x.dtype)
        if w is not None and ctx.needs_input_grad[1]:
            dw = (gy * xhat).sum(dims).to(w.dtype)  # this row's share: the sum over rows is inserted
        if ctx.needs_input_grad[2]:
            db = gy.sum(dims).to(b_dtype)
        return dx, dw, db, None, None, None, None, None, None, None, None


def _bn_dims(x: torch.Tensor) -> list:
    return [0] + list(range(2, x.dim()))


def _bn_shape(x: torch.Tensor) -> list:
    return [1, -1] + [1] * (x.dim() - 2)


BN_STATS = ((1, 2), (2,))  # per-channel statistics in each forward / backward all-reduce (batch over rows)


class SplitBatchNorm(nn.Module):
    """Training-mode batch norm with the batch over the mesh rows (`rows`) and/or the channels over the
    columns (`cols`); the running statistics stay whole on every rank. See `_BatchNormFn`."""

    def __init__(self, grid: Grid, momentum: float, eps: float, tag: str, rows: bool, cols: bool):
        super().__init__()
        self.grid, self.momentum, self.eps, self.tag = grid, momentum, eps, tag
        self.rows, self.cols = rows, cols

    def forward(self, x, w=None, b=None, running_mean=None, running_var=None):
        return _BatchNormFn.apply(x, w, b, running_mean, running_var, self.grid, self.momentum, self.eps,
                                  self.tag, self.rows, self.cols)

    def extra_repr(self) -> str:
        parts = (("batch over rows", self.rows), ("channels over columns", self.cols))
        split = " and ".join(k for k, on in parts if on)
        return f"momentum={self.momentum}, eps={self.eps}, {split}"
