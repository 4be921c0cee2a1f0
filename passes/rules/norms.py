"""LayerNorm / RMSNorm over the last dim, which the mesh columns split; batch norm over channels.

The per-token statistics are sums over the hidden dim: each rank sums its h/C slice and the sums are
all-reduced in the same-row group. LayerNorm sends 3 numbers per token forward (the sum, then the
shifted sum and sum of squares) and 2 backward; RMSNorm 1 each way (`passes.ops.modules.NORM_STATS`).
The weight and bias are split like the hidden dim and replicated over the rows.

An input split over the columns by tokens instead (1D's sequence-parallel residual), or a partial sum
over them (a row-split product's output), is normalized on sequence blocks with no communication: the
partial sum reduce-scattered onto the first token dim the columns divide, weight and bias whole
(their gradient summed over the grid).

Batch norm normalizes each channel over the batch and spatial dims: the batch is split over the rows
and the channels over the columns (weight, bias and running statistics by channel over the columns).
In eval mode, or with the batch whole on every row, it runs on the blocks alone; in training mode
with the batch split the per-channel statistics are all-reduced in the column (`BatchNormSpec`), and
each rank updates the running statistics of its channels.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from passes.kernels.local import BatchNormSpec, NormSpec
from passes.layout import REPLICATED, Layout, uneven_ok
from passes.meta import CHOICE
from passes.rules.registry import Strategy, Unsupported, kept_row_split, register
from passes.rules.views import TRANSPOSES, VIEWS, is_cast
from passes.nodes import arg, shape

aten = torch.ops.aten
NORMS = (aten.layer_norm.default, aten.rms_norm.default)


def consumer_choices(node) -> tuple:
    """The strategy choices (`CHOICE`) of the products that read a norm's output, through views,
    transposes and casts: what `norm_strategy` lays its output out for (and part of its rule's key)."""
    out, todo = [], list(node.users)
    while todo:
        u = todo.pop(0)
        if u.op == "call_function" and (u.target in VIEWS or u.target in TRANSPOSES or is_cast(u)):
            todo.extend(u.users)
        else:
            out.append(u.meta.get(CHOICE))
    return tuple(out)


def _rows(lay, shape_, rows: int):
    """Keep a batch-side split over mesh axis 0 (any dim but the last), else split the batch dim:
    a replicated input is sliced for free, a partial one reduce-scattered (cheaper than all-reduced)."""
    nd = len(shape_)
    kept = kept_row_split(lay, nd)
    if kept is not None:
        return kept
    # one row splits nothing, and a split of the token dim over it would keep the columns off it
    return Shard(0) if nd >= 2 and shape_[0] % rows == 0 and rows > 1 else Replicate()


def _sequence_block(lay, xs, rows, columns: int):
    """The columns' split of a token dim (not the last, not the rows') that a norm can run on with no
    communication: the one `x` arrives with (a sequence-parallel residual), or, for an input that is
    a partial sum over the columns (a row-split product's output, a vocabulary-split embedding's),
    the first such dim the columns divide, which a reduce-scatter fills; None otherwise."""
    nd = len(xs)
    if lay is None or nd < 2 or columns == 1:
        return None
    col = lay.normalized(nd)[1]
    taken = rows.dim if isinstance(rows, Shard) else None
    if isinstance(col, Shard) and col.dim not in (nd - 1, taken) and xs[col.dim] % columns == 0:
        return col
    if isinstance(col, Partial):
        return next((Shard(d) for d in range(nd - 1) if d != taken and xs[d] % columns == 0), None)
    return None


def norm_strategy(node, layouts, mesh, x, params, n_norm):
    if n_norm != 1:
        raise Unsupported("normalization over more than the last dim")
    xs = shape(x)
    nd = len(xs)
    rows = _rows(layouts.get(x), xs, mesh[0])
    lay = layouts.get(x)
    seq = _sequence_block(lay, xs, rows, mesh[1])
    users = consumer_choices(node)
    # whole over the columns (tokens gathered before a flattening view) and read by 1D column splits,
    # which want it whole: a hidden split here would make them row splits with partial sums
    whole = lay is not None and isinstance(lay.normalized(nd).placements[1], Replicate) and mesh[1] > 1 \
        and users and all(c in ("1d", "col") for c in users)
    if seq is not None or whole:  # each column normalizes whole tokens: its sequence block, or all of them
        need = {x: Layout((rows, seq if seq is not None else Replicate()))}
        need.update({p: REPLICATED for p in params if p is not None})
        note = "norm on sequence blocks (sequence parallel)" if seq is not None else \
            "norm whole over the columns (read by 1D column splits)"
        return Strategy(need, need[x], note=note)
    split = xs[-1] % mesh[1] == 0 or uneven_ok(mesh)  # uneven: torch.chunk blocks; the kernel divides by n
    x_lay = Layout((rows, Shard(nd - 1) if split else Replicate()))
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


@register(aten.batch_norm.default)
def batch_norm(node, layouts, mesh):
    # batch_norm(x, weight, bias, running_mean, running_var, training, momentum, eps, cudnn_enabled)
    x, w, b, rm, rv, training, momentum = (list(node.args) + [None] * 7)[:7]
    xs = shape(x)
    if len(xs) < 2:
        raise Unsupported("batch norm of a tensor without a channel dim")
    if training and not isinstance(momentum, (int, float)):
        raise Unsupported("batch norm with a computed momentum (momentum=None: a cumulative average)")
    rows = xs[0] % mesh[0] == 0 and mesh[0] > 1
    cols = xs[1] % mesh[1] == 0 and mesh[1] > 1
    x_lay = Layout((Shard(0) if rows else Replicate(), Shard(1) if cols else Replicate()))
    p_lay = Layout((Replicate(), Shard(0) if cols else Replicate()))
    need = {x: x_lay}
    need.update({p: p_lay for p in (w, b) if p is not None})
    running = rm is not None
    # the running statistics are buffers whole on every rank: updated in place in training (the kernel
    # updates them whole), read as this column's block in eval
    need.update({p: REPLICATED if training else p_lay for p in (rm, rv) if p is not None})
    if not training or not (rows or cols):
        return Strategy(need, x_lay, note="local batch norm")
    return Strategy(need, x_lay, kernel=BatchNormSpec(rows=rows, cols=cols, running=running),
                    note="batch norm: " + ", ".join(k for k, on in (("stats all-reduced over the column", rows),
                                                                    ("running stats all-gathered", cols and running))
                                                    if on))
