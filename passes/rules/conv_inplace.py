"""Convolutions (a ViT patch embedding) and in-place ops.

Convolution: the batch is split over mesh rows and the output channels over mesh columns; the
weight [C_out, C_in/groups, k...] is split by output channel over columns. With groups 1 the input
channels stay whole in the product, so it runs locally; a grouped convolution (depthwise included)
whose groups the columns divide splits the input channels too, along group boundaries, and each
column convolves its groups/C groups alone. A weight parameter whose dim 1 the rows divide is stored
split over the rows too and gathered in the column each step, its gradient reduce-scattered: the
bytes of the all-reduce a weight whole over the rows would need, 1/(RC) of it held (otherwise it is
whole over the rows and its gradient summed over them by the insertion pass). `kernelspec_local.ConvSpec`.

In-place ops (`add_`, `copy_`, `masked_fill_`, ...) mutate their first argument, so that argument
must be used as it is: the other operands are brought to its layout. Capture already rewrote those on
intermediate tensors out of place (`passes.capture.functionalize`); the ones left update a parameter, buffer,
input or a view whose base is read later. Such an op on a partial sum is not supported (it raises; a
replicated fallback would mutate a copy).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Replicate, Shard

from passes.kernels.local import ConvSpec
from passes.layout import REPLICATED, Layout, moved, split_dim
from passes.rules.registry import Strategy, Unsupported, register
from passes.nodes import arg, shape, tensor_inputs
from passes.rules.pointwise import dim_map

aten = torch.ops.aten


@register(aten.conv1d.default, aten.conv2d.default, aten.conv3d.default)
def conv(node, layouts, mesh):
    x, w = node.args[:2]
    b = arg(node, 2, "bias")
    groups = arg(node, 6, "groups", 1)
    xs, ws = shape(x), shape(w)
    if len(xs) != len(ws):
        raise Unsupported("unbatched convolution input")
    if groups != 1 and groups % mesh[1]:
        raise Unsupported(f"grouped convolution: {groups} groups, which the {mesh[1]} mesh columns do not divide")
    rows = Shard(0) if xs[0] % mesh[0] == 0 else Replicate()
    grouped = groups != 1 and mesh[1] > 1  # whole groups per column: the input channels split alike
    cols = Shard(0) if ws[0] % mesh[1] == 0 and mesh[1] > 1 else Replicate()
    need = {x: Layout((rows, Shard(1) if grouped else Replicate())), w: Layout((Replicate(), cols))}
    if b is not None:
        need[b] = Layout((Replicate(), cols))
    out = Layout((rows, Shard(1) if isinstance(cols, Shard) else Replicate()))
    stored = Layout((Shard(1), cols))  # a weight parameter kept split over the rows too, gathered per step
    gathered = isinstance(rows, Shard) and mesh[0] > 1 and ws[1] % mesh[0] == 0 and w.op == "placeholder" \
        and layouts.get(w) in (None, stored)
    if gathered:
        need[w] = stored
    what = f"grouped conv, {groups // mesh[1]} groups per column" if grouped else "conv"
    note = f"{what}: batch over rows, out-channels over columns" + (", weight gathered over rows" if gathered else "")
    return Strategy(need, out, kernel=ConvSpec(grouped, gathered) if grouped or gathered else None, note=note)


POOLS = {aten.max_pool1d.default: 1, aten.max_pool2d.default: 2, aten.max_pool3d.default: 3,
         aten.avg_pool1d.default: 1, aten.avg_pool2d.default: 2, aten.avg_pool3d.default: 3,
         aten.adaptive_avg_pool1d.default: 1, aten.adaptive_avg_pool2d.default: 2,
         aten.adaptive_avg_pool3d.default: 3, aten.adaptive_max_pool2d.default: 2}


@register(*POOLS)
def pool(node, layouts, mesh):
    """Pooling works per sample and channel over the spatial dims: the batch over the rows and the
    channels over the columns (where they divide), spatial dims whole; local."""
    x = node.args[0]
    xs = shape(x)
    if len(xs) != POOLS[node.target] + 2:
        raise Unsupported("unbatched pooling input")
    lay = Layout((Shard(0) if xs[0] % mesh[0] == 0 else Replicate(), Shard(1) if xs[1] % mesh[1] == 0 else Replicate()))
    out = lay if node.target != aten.adaptive_max_pool2d.default else (lay, lay)
    return Strategy({x: lay}, out, note="local pooling: batch over rows, channels over columns")


INPLACE = [aten.add_, aten.sub_, aten.mul_, aten.div_, aten.masked_fill_, aten.copy_, aten.clamp_,
           aten.fill_, aten.zero_, aten.neg_, aten.exp_, aten.tanh_, aten.relu_, aten.sigmoid_]


@register(*INPLACE)
def inplace(node, layouts, mesh):
    target = node.args[0]
    lay = layouts.get(target) or REPLICATED
    if lay.has_partial:
        raise Unsupported("in-place op on a partial sum")
    lay = lay.normalized(len(shape(target)))
    need = {target: lay}
    for n in tensor_inputs(node):
        if n is target:
            continue
        m = {o: i for i, o in dim_map(shape(n), shape(target)).items()}
        need[n] = Layout(tuple(moved(p, m[p.dim]) if split_dim(p) is not None and p.dim in m else Replicate()
                               for p in lay.placements))
    return Strategy(need, lay)
