"""Localization: rewrite the sizes baked into the graph from global to per-rank block sizes.

Requires `node.meta[LAYOUT]` on every node (from `propagate`). view / reshape / expand carry their target
sizes as integers (head counts, hidden sizes, batch); after this pass they hold the block's sizes,
computed from the node's global shape and its layout; split sizes become the pieces' block sizes (a
fused projection's output is split locally). Ops that build tensors from sizes (arange,
zeros, full) produce replicated whole tensors and keep theirs.
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule

from passes.layout import local_shape
from passes.meta import LAYOUT
from passes.rules import arg

aten = torch.ops.aten
_SIZED = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.expand.default}


def localize(gm: GraphModule, mesh) -> GraphModule:
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in _SIZED:
            size = local_shape(tuple(node.meta["val"].shape), node.meta[LAYOUT], mesh, node.name)
            node.args = (node.args[0], list(size)) + tuple(node.args[2:])
        elif node.op == "call_function" and node.target in (aten.split.Tensor, aten.split_with_sizes.default):
            x = node.args[0]
            dim = arg(node, 2, "dim", 0) % len(x.meta["val"].shape)
            sizes = [local_shape(tuple(v.shape), lay, mesh, node.name)[dim]
                     for v, lay in zip(node.meta["val"], node.meta[LAYOUT])]
            size_arg = sizes[0] if node.target == aten.split.Tensor else sizes
            node.args = (x, size_arg) + tuple(node.args[2:])
        elif node.op == "call_function" and node.target == aten.unflatten.int:
            x, dim, _ = node.args
            out = local_shape(tuple(node.meta["val"].shape), node.meta[LAYOUT], mesh, node.name)
            n = len(node.meta["val"].shape) - len(x.meta["val"].shape) + 1
            dim = dim % len(x.meta["val"].shape)
            node.args = (x, dim, list(out[dim:dim + n]))
    gm.graph.lint()
    gm.recompile()
    return gm
