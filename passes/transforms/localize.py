"""Localization: rewrite the sizes baked into the graph from global to per-rank block sizes.

Requires `node.meta[LAYOUT]` on every node (from `propagate`). view / reshape / expand carry their target
sizes as integers (head counts, hidden sizes, batch); after this pass they hold the block's sizes,
computed from the node's global shape, its layout and the rank's grid coordinates (a dim the grid does
not divide has torch.chunk blocks of unequal sizes); split sizes become the pieces' block sizes (a
fused projection's output is split locally). Ops that build tensors from sizes (arange,
zeros, full) produce replicated whole tensors and keep theirs.

Every `view` becomes a `reshape`: a view is valid for the strides one process had, and a rank's
tensor can have others (a head block sliced out of a whole tensor, then transposed:
capture drops a `.contiguous()` that was a no-op on one process, as after CPU SDPA in nanoGPT's
`y.transpose(1, 2).contiguous().view(B, T, C)`). reshape is that view wherever the strides allow
one, and a copy where they do not; capture left no in-place op that could write through the view.
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule

from passes.layout import local_shape
from passes.meta import CAPTURED_AS, LAYOUT, PLAN_ARGS
from passes.nodes import arg
from passes.rules.views import VIEWS

aten = torch.ops.aten
_SIZED = {*VIEWS, aten.expand.default}
_SPLITS = {aten.split.Tensor, aten.split_with_sizes.default}
LOCALIZED = _SIZED | _SPLITS | {aten.unflatten.int}
_VIEWS = {aten.view.default, aten._unsafe_view.default}  # become reshape (see the module docstring)


def localize(gm: GraphModule, mesh, at: tuple = (0, 0)) -> GraphModule:
    """`at`: this rank's grid coordinates (r, c), which give its torch.chunk block of a dim the grid
    does not divide (the blocks of other dims are the same on every rank). Where this rank's args
    differ from grid position (0, 0)'s, those are kept in `node.meta[PLAN_ARGS]`."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in _VIEWS:
            node.meta[CAPTURED_AS] = node.target
            node.target = aten.reshape.default
        if node.op == "call_function" and node.target in LOCALIZED:
            args = local_args(node, mesh, at)
            if tuple(at) != (0, 0):
                origin = local_args(node, mesh, (0, 0))
                if origin != args:
                    node.meta[PLAN_ARGS] = origin
            node.args = args
    gm.graph.lint()
    gm.recompile()
    return gm


def local_args(node, mesh, at: tuple) -> tuple:
    """The node's args with its baked sizes those of the block at grid position `at`."""
    if node.target in _SIZED:
        size = local_shape(tuple(node.meta["val"].shape), node.meta[LAYOUT], mesh, node.name, at)
        return (node.args[0], list(size)) + tuple(node.args[2:])
    if node.target in _SPLITS:
        x = node.args[0]
        dim = arg(node, 2, "dim", 0) % len(x.meta["val"].shape)
        sizes = [local_shape(tuple(v.shape), lay, mesh, node.name, at)[dim]
                 for v, lay in zip(node.meta["val"], node.meta[LAYOUT])]
        size_arg = sizes[0] if node.target == aten.split.Tensor else sizes
        return (x, size_arg) + tuple(node.args[2:])
    x, dim, _ = node.args  # unflatten
    out = local_shape(tuple(node.meta["val"].shape), node.meta[LAYOUT], mesh, node.name, at)
    n = len(node.meta["val"].shape) - len(x.meta["val"].shape) + 1
    dim = dim % len(x.meta["val"].shape)
    return (x, dim, list(out[dim:dim + n]))
