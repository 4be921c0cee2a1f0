"""A weight gradient's reduction launched before the input gradient's product and waited for after it.

The backward of a SUMMA linear runs two products that read neither's result: dX (ABT or AB, with its
own broadcasts or gathers, matmuls and reduction over the columns) and dW = x^T dY (ATB), whose partial
sums are reduced over the mesh rows (one reduce per step in the broadcast lowering, one reduce-scatter
in the all-gather lowering). Run one after the other, dW's reduction sits on the critical path. Here
backward splits dW in two ops around dX:

    atb_post   dW's broadcasts or gather, its matmuls, then its reduction launched, not waited for
    (dX)       the product as before: its collectives posted while dW's reduction is in flight
    atb_wait   wait for dW's reduction and assemble dW, the gradient autograd then accumulates

Every rank runs the same collectives, with the same bytes and launches, in the same order (dW's first,
then dX's), eager and compiled alike: both ops are ORDERED-effectful torch.library ops, as those of
`passes.ops.library`, so a compiled backward keeps the order and the overlap. Nothing reads dW's
partials before `atb_wait`, and backward returns only the finished dW, so gradient accumulation into
an existing .grad sees what it saw before. What is in flight between the two ops is kept here, under
(grid key, tag): the two calls of one product's backward are adjacent in program order, so one entry
per product at a time. A grid whose `overlap_grad_reduce` is False runs dX then dW, each waited for
in line (the order before this module).

>>> import torch
>>> from passes.mesh import Grid
>>> g = Grid.for_planning(2, 4)
>>> from passes.compat import fake_tensor_mode
>>> with fake_tensor_mode():  # x [m, K/C], dY [m, N/C] -> dW [K/R, N/C]: shapes only, nothing sent
...     x, dy = torch.empty(6, 3), torch.empty(6, 5)
...     torch.ops.autopar.atb_post(x, dy, g.key, "w", "broadcast", False)
...     torch.ops.autopar.atb_wait(x, dy, g.key, "w", "broadcast", False).shape
torch.Size([6, 5])
"""

from __future__ import annotations

from typing import Optional

import torch

from passes.compat import register_ordered
from passes.mesh import grid_of
from passes.ops import summa, summa_group
from passes.ops.comm import Posted
from passes.ops.library import summa_shape

_IN_FLIGHT: dict = {}  # (grid key, tag) -> Posted: dW's reduction between its post and its wait


def _post(key: tuple, posted: Posted) -> None:
    # an entry left by a backward that failed between the two ops (a CollectiveError) is replaced
    _IN_FLIGHT[key] = posted


def _wait(key: tuple):
    posted = _IN_FLIGHT.pop(key, None)
    assert posted is not None, f"atb_wait for {key[1]!r} without its atb_post: the two must run in program order"
    return posted.wait()


@torch.library.custom_op("autopar::atb_post", mutates_args=())
def atb_post(a: torch.Tensor, b: torch.Tensor, grid: int, tag: str, lowering: str, rows_whole: bool,
             full: Optional[int] = None) -> None:
    """`summa.post_atb` of the local blocks a, b in phase "bwd", kept for `atb_wait`."""
    _post((grid, tag), summa.post_atb(grid_of(grid), a, b, tag, "bwd", lowering, rows_whole, full))


@atb_post.register_fake
def _(a, b, grid, tag, lowering, rows_whole, full=None):
    return None


@torch.library.custom_op("autopar::atb_wait", mutates_args=())
def atb_wait(a: torch.Tensor, b: torch.Tensor, grid: int, tag: str, lowering: str, rows_whole: bool,
             full: Optional[int] = None) -> torch.Tensor:
    """The ATB product `atb_post` launched with these arguments, once its reduction is done."""
    return _wait((grid, tag))


@atb_wait.register_fake
def _(a, b, grid, tag, lowering, rows_whole, full=None):
    return a.new_empty(summa_shape(grid_of(grid), "atb", a, b, full))


@torch.library.custom_op("autopar::atb_group_post", mutates_args=())
def atb_group_post(x: torch.Tensor, gs: list[torch.Tensor], grid: int, tags: str) -> None:
    """`summa_group.post_atb` of x and the members' dY, kept for `atb_group_wait`."""
    _post((grid, tags), summa_group.post_atb(grid_of(grid), x, gs, tags.split(summa_group.SEP)))


@atb_group_post.register_fake
def _(x, gs, grid, tags):
    return None


@torch.library.custom_op("autopar::atb_group_wait", mutates_args=())
def atb_group_wait(x: torch.Tensor, gs: list[torch.Tensor], grid: int, tags: str) -> list[torch.Tensor]:
    """The members' dW that `atb_group_post` launched with these arguments, once reduced."""
    return _wait((grid, tags))


@atb_group_wait.register_fake
def _(x, gs, grid, tags):
    R, C = grid_of(grid).shape
    return [x.new_empty(x.shape[1] * C // R, g.shape[1]) for g in gs]


for _name in ("atb_post", "atb_wait", "atb_group_post", "atb_group_wait"):
    register_ordered(f"autopar::{_name}")

