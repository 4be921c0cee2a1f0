"""LayerNorm / RMSNorm over the last dim, which the mesh columns split.

The per-token statistics are sums over the hidden dim: each rank sums its h/C slice and the sums are
all-reduced in the same-row group. LayerNorm sends 3 numbers per token forward (the sum, then the
shifted sum and sum of squares) and 2 backward; RMSNorm 1 each way (`passes.ops.kernels.NORM_STATS`).
The weight and bias are split like the hidden dim and replicated over the rows.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Replicate, Shard

from passes.kernelspec import NormSpec
from passes.layout import Layout, uneven_ok
from passes.rules import Strategy, Unsupported, arg, kept_row_split, register, shape

aten = torch.ops.aten


def _rows(lay, shape_, rows: int):
    """Keep a batch-side split over mesh axis 0 (any dim but the last), else split the batch dim:
    a replicated input is sliced for free, a partial one reduce-scattered (cheaper than all-reduced)."""
    nd = len(shape_)
    kept = kept_row_split(lay, nd)
    if kept is not None:
        return kept
    return Shard(0) if nd >= 2 and shape_[0] % rows == 0 else Replicate()


def norm_strategy(node, layouts, mesh, x, params, n_norm):
    if n_norm != 1:
        raise Unsupported("normalization over more than the last dim")
    xs = shape(x)
    nd = len(xs)
    split = xs[-1] % mesh[1] == 0 or uneven_ok(mesh)  # uneven: torch.chunk blocks; the kernel divides by n
    x_lay = Layout((_rows(layouts.get(x), xs, mesh[0]), Shard(nd - 1) if split else Replicate()))
    p_lay = Layout((Replicate(), Shard(0) if split else Replicate()))
    need = {x: x_lay}
    need.update({p: p_lay for p in params if p is not None})
    kernel = NormSpec(centered=node.target == aten.layer_norm.default) if split else None
    return Strategy(need, x_lay, kernel=kernel,
                    note="norm stats all-reduced over the row" if split else "")


@register(aten.layer_norm.default)
def layer_norm(node, layouts, mesh):
    x, normalized_shape = node.args[:2]
    w, b = arg(node, 2, "weight"), arg(node, 3, "bias")
    return norm_strategy(node, layouts, mesh, x, (w, b), len(normalized_shape))


@register(aten.rms_norm.default)
def rms_norm(node, layouts, mesh):
    x, normalized_shape = node.args[:2]
    w = arg(node, 2, "weight")
    return norm_strategy(node, layouts, mesh, x, (w,), len(normalized_shape))
