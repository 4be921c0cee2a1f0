"""Sibling SUMMA products in one set of collective calls: linears that read the same activation.

q, k and v (or gate and up) each multiply the same x [m, K/C] by their own weight, whose local block
is [K/R, N_i/C] (AB, `passes.ops.summa`). The all-gather lowering runs each product with one call per
mesh axis, and each of them gathers the same x panel. Here the k products run as one: forward one
all-gather of x over the columns and one of the k weight blocks side by side over the rows; backward
one reduce-scatter of dX (the k products summed by one matmul) and one all-gather of x plus one
reduce-scatter of the k weight gradients side by side. 2k calls per product become 2, and x's panel
and dX's partial sums move once instead of k times: the lead member (the first) receives those bytes,
each member its own weight's (`Grid.log`, under each member's tag; a call counted under the lead's).

>>> import torch
>>> from passes.mesh import Grid
>>> g = Grid.for_planning(2, 4)
>>> from passes.compat import fake_tensor_mode
>>> with fake_tensor_mode():  # x [m, K/C]; weight blocks [K/R, N_i/C] -> [m, N_i/C]: shapes only
...     x, ws = torch.empty(6, 3), [torch.empty(6, 4), torch.empty(6, 2)]
...     [tuple(y.shape) for y in torch.ops.autopar.ab_group(x, ws, g.key, "q|k")]
[(6, 4), (6, 2)]
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn as nn

from passes.compat import register_ordered
from passes.cost.volumes import all_gather_bytes, reduce_scatter_bytes
from passes.mesh import Grid, grid_of
from passes.ops.comm import Posted, tensor_bytes, post_reduce_scatter, run_all_gather, run_reduce_scatter
from passes.ops.summa import AXIS_SAME_COL, AXIS_SAME_ROW, backward_pair

SEP = "|"  # joins the members' tags into one op argument (a torch.library op takes no list of str)


def _gather(grid: Grid, axis: int, t: torch.Tensor, dim: int, received: list, phase: str) -> torch.Tensor:
    """All-gather of t along dim over `axis`; `received`: (tag, bytes) this rank counts for it, the call
    under the first tag."""
    if grid.size(axis) == 1:
        return t
    return run_all_gather(grid, axis, t, dim, received[0][0], phase, received)


def _reduce_scatter(grid: Grid, axis: int, t: torch.Tensor, dim: int, received: list, phase: str) -> torch.Tensor:
    """Sum of the members' t, this member's block of dim; `received` as in `_gather`."""
    if grid.size(axis) == 1:
        return t
    return run_reduce_scatter(grid, axis, t, dim, received[0][0], phase, received)


def _weights(grid: Grid, ws: list, tags: list, phase: str) -> torch.Tensor:
    """The k weight blocks side by side, gathered over the rows: [K, sum N_i/C]."""
    received = [(t, all_gather_bytes(tensor_bytes(w), grid.size(AXIS_SAME_COL))) for t, w in zip(tags, ws)]
    return _gather(grid, AXIS_SAME_COL, torch.cat(ws, 1), 0, received, phase)


def _x_panel(grid: Grid, x: torch.Tensor, tags: list, phase: str) -> torch.Tensor:
    """x's row panel [m, K], gathered once for the group (counted by the lead)."""
    received = [(tags[0], all_gather_bytes(tensor_bytes(x), grid.size(AXIS_SAME_ROW)))]
    return _gather(grid, AXIS_SAME_ROW, x, 1, received, phase)


def _split(t: torch.Tensor, like: list) -> list:
    """t's columns, one new tensor per member, as wide as its weight block."""
    return [p.clone(memory_format=torch.contiguous_format) for p in t.split([w.shape[1] for w in like], 1)]


def ab(grid: Grid, x, ws: list, tags: list) -> list:
    """[x W_i] for x [m, K/C] and weight blocks [K/R, N_i/C]: [[m, N_i/C]]."""
    return _split(_x_panel(grid, x, tags, "fwd") @ _weights(grid, ws, tags, "fwd"), ws)


def abt(grid: Grid, gs: list, ws: list, tags: list) -> torch.Tensor:
    """dX = sum_i dY_i W_i^T for dY_i [m, N_i/C]: [m, K/C] (one reduce-scatter, counted by the lead)."""
    part = torch.cat(gs, 1) @ _weights(grid, ws, tags, "bwd").t()  # [m, K], partial over the columns
    C = grid.size(AXIS_SAME_ROW)
    dx = _reduce_scatter(grid, AXIS_SAME_ROW, part, 1, [(tags[0], reduce_scatter_bytes(tensor_bytes(part), C))], "bwd")
    return dx.contiguous()  # the layout the fake kernel promises


def post_atb(grid: Grid, x, gs: list, tags: list) -> Posted:
    """dW_i = x^T dY_i, the weight gradients [[K/R, N_i/C]], once the returned reduce-scatter over the
    rows is waited for (launched, not waited: `passes.ops.overlap`'s atb_group ops)."""
    prod = _x_panel(grid, x, tags, "bwd").t() @ torch.cat(gs, 1)  # [K, sum N_i/C], partial over the rows
    R, K = grid.size(AXIS_SAME_COL), prod.shape[0]
    received = [(t, reduce_scatter_bytes(K * g.shape[1] * prod.element_size(), R)) for t, g in zip(tags, gs)]
    posted = post_reduce_scatter(grid, AXIS_SAME_COL, prod, 0, tags[0], "bwd", received)
    return dataclasses.replace(posted, finish=lambda: _split(posted.finish(), gs))


@torch.library.custom_op("autopar::ab_group", mutates_args=())
def ab_op(x: torch.Tensor, ws: list[torch.Tensor], grid: int, tags: str) -> list[torch.Tensor]:
    return ab(grid_of(grid), x, ws, tags.split(SEP))


@ab_op.register_fake
def _(x, ws, grid, tags):
    return [x.new_empty(x.shape[0], w.shape[1]) for w in ws]


@torch.library.custom_op("autopar::abt_group", mutates_args=())
def abt_op(gs: list[torch.Tensor], ws: list[torch.Tensor], grid: int, tags: str) -> torch.Tensor:
    return abt(grid_of(grid), gs, ws, tags.split(SEP))


@abt_op.register_fake
def _(gs, ws, grid, tags):
    R, C = grid_of(grid).shape
    return gs[0].new_empty(gs[0].shape[0], ws[0].shape[0] * R // C)


for _name in ("ab_group", "abt_group"):  # run in program order when compiled, as `passes.ops.library`'s
    register_ordered(f"autopar::{_name}")


class SummaGroupAB(torch.autograd.Function):
    """[x W_i] for sibling weights; backward dX = sum_i dY_i W_i^T, dW_i = x^T dY_i, each one grouped
    product (`ab`, `abt`, `atb`)."""

    @staticmethod
    def forward(ctx, x, grid, tags, *ws):
        ctx.save_for_backward(x, *ws)
        ctx.grid, ctx.tags = grid, tags
        return tuple(torch.ops.autopar.ab_group(x, list(ws), grid.key, tags))

    @staticmethod
    def backward(ctx, *gs):
        x, *ws = ctx.saved_tensors
        gs = [g.contiguous() for g in gs]
        key, tags = ctx.grid.key, ctx.tags
        dx = (lambda: torch.ops.autopar.abt_group(gs, ws, key, tags)) if ctx.needs_input_grad[0] else None
        post, wait = None, None
        if any(ctx.needs_input_grad[3:]):  # dW's reduce-scatter overlaps dX (`passes.ops.overlap`)
            post, wait = (lambda: torch.ops.autopar.atb_group_post(x, gs, key, tags)), \
                (lambda: torch.ops.autopar.atb_group_wait(x, gs, key, tags))
        dx, dws = backward_pair(ctx.grid, dx, post, wait)
        return (dx, None, None, *(dws if dws is not None else [None] * len(ws)))


class SummaGroup(nn.Module):
    """k sibling `kernels.SummaLinear` products (AB, all-gather lowering) of one x: forward(x, *w) ->
    the k outputs [..., N_i/C], each weight block transposed first where its member's `flip` says."""

    def __init__(self, grid: Grid, flips: tuple, tags: tuple):
        super().__init__()
        self.grid, self.flips, self.tags = grid, flips, tags

    def forward(self, x, *ws):
        ws = tuple(w.t() if f else w for w, f in zip(ws, self.flips))
        dev = x.device.type
        if torch.is_autocast_enabled(dev):  # as `summa.summa_matmul`: both operands cast
            dtype = torch.get_autocast_dtype(dev)
            x, ws = x.to(dtype), tuple(w.to(dtype) for w in ws)
        lead = x.shape[:-1]
        x2 = x.reshape(math.prod(lead), x.shape[-1])  # [m, K/C]
        ws, tags = tuple(w.contiguous() for w in ws), SEP.join(self.tags)
        if torch.is_grad_enabled() and (x2.requires_grad or any(w.requires_grad for w in ws)):
            outs = SummaGroupAB.apply(x2, self.grid, tags, *ws)
        else:  # no backward (generation): the product alone; dynamo mis-binds the Function's *ws here
            outs = tuple(torch.ops.autopar.ab_group(x2, list(ws), self.grid.key, tags))
        return tuple(y.view(*lead, y.shape[-1]) for y in outs)

    def extra_repr(self) -> str:
        return f"AB x{len(self.tags)}, lowering=allgather: {', '.join(self.tags)}"


class SummaMember(nn.Module):
    """Product `i` of a `SummaGroup` (plus its bias): called with its own linear's arguments (x, w, b),
    which the graph keeps for `explain` and the cost model, and the group's outputs."""

    lowering = "allgather"

    def __init__(self, i: int):
        super().__init__()
        self.i = i

    def forward(self, x, w, b=None, *, group):
        y = group[self.i]
        return y if b is None else y + b.to(y.dtype)

    def extra_repr(self) -> str:
        return f"member {self.i} of a SUMMA group"
