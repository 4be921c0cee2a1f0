"""Shape ops: transpose/permute (and their aliases .T, .mT, .mH, swapaxes, movedim), view/reshape,
unsqueeze/squeeze, expand, slice, split, cat.

view/reshape sizes are baked integers in the captured graph; `localize` rewrites them from the
output layout, so these rules only decide which dims stay split. A split dim survives a reshape when
it is the outermost dim of its group of merged/split dims and the matching output dim is divisible
by q (contiguous blocks stay contiguous); otherwise that axis is gathered first, except where only
the blocking changes (hidden blocks <-> head blocks when the columns do not divide the heads): then
the view becomes a reblocking all-to-all that moves only the overlaps (`passes.ops.reblock`).
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from passes.kernels.spec import ReblockSpec
from passes.layout import REPLICATED, Layout, moved, parts, split_dim, uneven_ok
from passes.rules.registry import Strategy, register, whole_along
from passes.nodes import arg, shape, tensor_inputs, val
from passes.ops.reblock import bounds
from passes.rules.pointwise import dim_map

aten = torch.ops.aten
# the ops that only reshape (the same elements in the same order, sizes baked into the graph)
VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
# every op that only reorders dims: a weight used through one of them (`x @ w.T`) is placed by its consumer
TRANSPOSES = (aten.transpose.int, aten.t.default, aten.permute.default, aten.numpy_T.default, aten.mT.default,
              aten.mH.default, aten.adjoint.default, aten.swapaxes.default, aten.swapdims.default,
              aten.movedim.int, aten.movedim.intlist)
_LAST_TWO = (aten.mT.default, aten.mH.default, aten.adjoint.default)  # swap the last two dims (mH conjugates)


def is_cast(node) -> bool:
    """A dtype cast and nothing else (`w.bfloat16()`, `w.to(torch.float32)`): a parameter read through
    one is placed by the cast's consumer, as through a transpose (DeepSeek-V3 in torchtitan casts its
    fp32 experts to bf16 before the grouped product)."""
    if node.op != "call_function":
        return False
    if node.target == aten.to.dtype:
        return not any(k in node.kwargs for k in ("memory_format",)) and len(node.args) <= 2
    if node.target == aten._to_copy.default:
        return len(node.args) == 1 and set(node.kwargs) <= {"dtype"}
    return False


def _input_layout(layouts, x):
    lay = layouts[x]
    if lay is None:
        return None
    return lay.normalized(len(shape(x)))


def _through(x_lay, mapping, out_shape, mesh, in_shape=None):
    """Keep each axis's split if `mapping` sends its dim somewhere divisible; else ask for it whole.
    An interleaved (Strided) split survives only a dim that keeps its size; so does a dim the axis
    does not divide (torch.chunk blocks of another size would not be the same elements)."""
    need, out = [], []
    for axis, p in enumerate(x_lay.placements):
        if split_dim(p) is not None:
            od = mapping.get(p.dim)
            kept = in_shape is not None and od is not None and in_shape[p.dim] == out_shape[od]
            same = parts(p) == 1 or kept
            even = od is not None and out_shape[od] % mesh[axis] == 0 and (
                in_shape is None or in_shape[p.dim] % mesh[axis] == 0)
            if od is not None and (even or (kept and uneven_ok(mesh))) and same:
                need.append(p)
                out.append(moved(p, od))
                continue
            p = Replicate()
        need.append(p)
        out.append(p)
    return Layout(tuple(need)), Layout(tuple(out))


def _perm_rule(node, layouts, mesh, perm):
    x = node.args[0]
    lay = _input_layout(layouts, x)  # never None: propagate defers transposes of unplaced weights
    inv = {src: dst for dst, src in enumerate(perm)}
    need, out = _through(lay, inv, tuple(val(node).shape), mesh, shape(x))
    return Strategy({x: need}, out)


def permutation(node) -> list:
    """perm of a transpose-like node (see TRANSPOSES): output dim i is input dim perm[i]; the identity
    for a cast (`is_cast`)."""
    nd = len(shape(node.args[0]))
    if is_cast(node):
        return list(range(nd))
    if node.target == aten.permute.default:
        return [d % nd for d in node.args[1]]
    if node.target in (aten.t.default, aten.numpy_T.default):  # .T reverses every dim
        return list(range(nd))[::-1]
    if node.target in (aten.movedim.int, aten.movedim.intlist):
        return _movedim(nd, node.args[1], node.args[2])
    a, b = (nd - 2, nd - 1) if node.target in _LAST_TWO else (node.args[1] % nd, node.args[2] % nd)
    perm = list(range(nd))
    perm[a], perm[b] = perm[b], perm[a]
    return perm


def _movedim(nd: int, src, dst) -> list:
    """movedim's perm: each source dim lands at its destination, the rest keep their order."""
    src = [d % nd for d in (src if isinstance(src, (list, tuple)) else [src])]
    dst = [d % nd for d in (dst if isinstance(dst, (list, tuple)) else [dst])]
    perm = [-1] * nd
    for s, d in zip(src, dst):
        perm[d] = s
    rest = iter(d for d in range(nd) if d not in src)
    return [p if p >= 0 else next(rest) for p in perm]


@register(*TRANSPOSES)
def transpose(node, layouts, mesh):
    return _perm_rule(node, layouts, mesh, permutation(node))


def reshape_groups(src, dst) -> list:
    """Pair up runs of input and output dims with equal products: [([in dims], [out dims]), ...]."""
    groups, i, j = [], 0, 0
    while i < len(src) or j < len(dst):
        gi: list[int] = []
        gj: list[int] = []
        pi, pj = 1, 1
        while True:
            if pi == pj and gi and gj:
                break
            if i >= len(src) and j >= len(dst):  # only size-1 dims were left (a 0-d side)
                break
            if (pi <= pj and i < len(src)) or j >= len(dst):
                gi.append(i)
                pi *= src[i]
                i += 1
            else:
                gj.append(j)
                pj *= dst[j]
                j += 1
        # size-1 dims that trail a finished group join it
        while i < len(src) and src[i] == 1 and (j >= len(dst) or dst[j] != 1):
            gi.append(i)
            i += 1
        while j < len(dst) and dst[j] == 1 and (i >= len(src) or src[i] != 1):
            gj.append(j)
            j += 1
        groups.append((gi, gj))
    return groups


def reshape_mapping(src, dst) -> dict:
    """Input dim -> output dim for the dims whose split survives a reshape (outermost of a group)."""
    mapping = {}
    for gi, gj in reshape_groups(src, dst):
        ins = [d for d in gi if src[d] != 1]
        outs = [d for d in gj if dst[d] != 1]
        if ins and outs:
            mapping[ins[0]] = outs[0]
    return mapping


@register(*VIEWS, aten.flatten.using_ints, aten.unflatten.int, aten.unsqueeze.default, aten.squeeze.dim,
          aten.squeeze.dims, aten.squeeze.default)
def reshape(node, layouts, mesh):
    return _mapped(node, layouts, mesh, reshape_mapping)


@register(aten.expand.default)
def expand(node, layouts, mesh):
    return _mapped(node, layouts, mesh, dim_map)  # expand broadcasts like an elementwise op


def _mapped(node, layouts, mesh, mapping):
    """x's splits carried to the dims `mapping(in shape, out shape)` sends them to (see `_through`)."""
    x = node.args[0]
    # a view of an unplaced parameter stores it whole: propagate passes a consumer's request back
    # through transposes only, and would misread a view as one
    lay = _input_layout(layouts, x) or REPLICATED
    src, dst = shape(x), tuple(val(node).shape)
    need, out = _through(lay, mapping(src, dst), dst, mesh, src)
    if mapping is reshape_mapping:
        kept = _reblock(lay, need, out, src, dst, mesh, node.name)
        if kept is not None:
            spec, need, out = kept
            note = "blocks change (hidden <-> heads, batch rows <-> token rows): only the overlaps move" if spec else ""
            return Strategy({x: need}, out, kernel=spec, note=note)
    return Strategy({x: need}, out)


def _reblock(lay, need, out, src, dst, mesh, name):
    """A reshape that `_through` would gather over an axis because the blocks of a split dim change
    (hidden h = heads x head_dim in torch.chunk blocks of h on one side, of the heads on the other):
    keep the split and move only the overlaps instead (`ReblockSpec`), when the split dim is the
    outermost of its group of merged/split dims, one side of the group is a single dim and no
    other axis splits a dim of the group: (spec, need, out); spec None where both sides' blocks hold
    the same elements (the split passes through). None where none of that applies."""
    if not uneven_ok(mesh):
        return None
    for axis, p in enumerate(lay.placements):
        if not isinstance(p, Shard) or need[axis] == p or mesh[axis] == 1:
            continue
        for gi, gj in reshape_groups(src, dst):
            ins, outs = [d for d in gi if src[d] != 1], [d for d in gj if dst[d] != 1]
            if not ins or ins[0] != p.dim or not outs or (len(ins) > 1 and len(outs) > 1):
                continue
            other = need[1 - axis], out[1 - axis]
            if split_dim(other[0]) in gi or split_dim(other[1]) in gj:
                return None
            q = mesh[axis]
            blocks = (bounds(src[ins[0]], q, math.prod(src[d] for d in ins[1:])),
                      bounds(dst[outs[0]], q, math.prod(dst[d] for d in outs[1:])))
            spec = None if blocks[0] == blocks[1] else ReblockSpec(axis, tuple(gi), *blocks, tag=name)
            return spec, need.with_axis(axis, p), out.with_axis(axis, Shard(outs[0]))
    return None


@register(aten.slice.Tensor, aten.narrow.default)
def slice_(node, layouts, mesh):
    x = node.args[0]
    nd = len(shape(x))
    dim = arg(node, 1, "dim", 0) % nd
    if shape(x)[dim] == val(node).shape[dim]:  # a full slice is a no-op on any layout
        lay = _input_layout(layouts, x) or REPLICATED
        return Strategy({x: lay}, lay)
    lay = whole_along(layouts, x, dim)
    return Strategy({x: lay}, lay)


@register(aten.select.int)
def select(node, layouts, mesh):
    x = node.args[0]
    dim = node.args[1] % len(shape(x))
    lay = whole_along(layouts, x, dim)
    out = tuple(moved(p, p.dim - (p.dim > dim)) if split_dim(p) is not None else p for p in lay.placements)
    return Strategy({x: lay}, Layout(out))


@register(aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default, aten.unbind.int)
def split(node, layouts, mesh):
    x = node.args[0]
    nd = len(shape(x))
    n = len(val(node))
    if node.target == aten.unbind.int:
        # the pieces have one dim fewer than x (x-transformers' rotary unbinds the last one): splits
        # of the dims after `dim` move down by one
        dim = arg(node, 1, "dim", 0) % nd
        lay = whole_along(layouts, x, dim)
        out = Layout(tuple(moved(p, p.dim - (p.dim > dim)) if split_dim(p) is not None else p for p in lay.placements))
        return Strategy({x: lay}, (out,) * n)
    dim = arg(node, 2, "dim", 0) % nd
    have = _input_layout(layouts, x)
    sizes = {t.shape[dim] for t in val(node)}
    if have is not None and len(sizes) == 1 and any(parts(p) == n and split_dim(p) == dim for p in have.placements):
        # a fused projection's output split into its n parts: each rank holds its block of every part
        out = Layout(tuple(Shard(dim) if split_dim(p) == dim else p for p in have.placements))
        return Strategy({x: have}, (out,) * n)
    lay = whole_along(layouts, x, dim)
    return Strategy({x: lay}, (lay,) * n)


@register(aten.cat.default)
def cat(node, layouts, mesh):
    xs = tensor_inputs(node)
    nd = len(val(node).shape)
    dim = arg(node, 1, "dim", 0) % nd
    lay = whole_along(layouts, xs[0], dim)
    return Strategy({x: lay for x in xs}, lay)


@register(aten.repeat.default)
def repeat(node, layouts, mesh):
    x = node.args[0]
    reps = list(node.args[1])
    off = len(reps) - len(shape(x))
    lay = _input_layout(layouts, x) or REPLICATED
    ps = tuple(
        Replicate() if isinstance(p, Partial) or (split_dim(p) is not None and reps[p.dim + off] != 1) else p
        for p in lay.placements
    )
    need = Layout(ps)
    out = Layout(tuple(moved(p, p.dim + off) if split_dim(p) is not None else p for p in ps))
    return Strategy({x: need}, out)


@register(aten.view_as_complex.default)
def view_as_complex(node, layouts, mesh):
    """x [..., 2] (real, imaginary) -> [...] complex: the pair stays whole on every rank; every other
    dim keeps its split and its index (torchtitan's rotary embedding views q and k this way). Linear,
    so a partial sum stays partial."""
    x = node.args[0]
    nd = len(shape(x))
    lay = (layouts[x] or REPLICATED).normalized(nd)
    need = Layout(tuple(Replicate() if split_dim(p) == nd - 1 else p for p in lay.placements))
    return Strategy({x: need}, need)


@register(aten.view_as_real.default)
def view_as_real(node, layouts, mesh):
    """x [...] complex -> [..., 2]: every split kept at its dim, the new pair dim whole."""
    x = node.args[0]
    lay = (layouts[x] or REPLICATED).normalized(len(shape(x)))
    return Strategy({x: lay}, lay)


@register(aten.repeat_interleave.self_int)
def repeat_interleave(node, layouts, mesh):
    """Each element of `dim` repeated r times in place (litgpt's grouped KV heads): splits of the other
    dims are kept; a split of `dim` is kept when the axis divides it evenly (block b of the output is
    then the repeats of block b of the input), and gathered otherwise. Without `dim`, the input is
    flattened: it is taken whole."""
    x = node.args[0]
    nd = len(shape(x))
    dim = arg(node, 2, "dim", None)
    lay = (layouts[x] or REPLICATED).normalized(nd)
    sized = node.kwargs.get("output_size") is not None  # a baked global size of `dim`: keep it whole
    if dim is None:
        return Strategy({x: REPLICATED}, REPLICATED)
    dim %= nd
    need = []
    for axis, p in enumerate(lay.placements):
        if isinstance(p, Partial) or (split_dim(p) == dim and (sized or shape(x)[dim] % mesh[axis] or parts(p) != 1)):
            p = Replicate()
        need.append(p)
    need_lay = Layout(tuple(need))
    return Strategy({x: need_lay}, need_lay)
