"""Elementwise ops with broadcasting, and reductions over dims.

Broadcasting aligns dims from the right. An output dim is split over a mesh axis when some input
already splits the matching dim over that axis; every input that has the dim at full size must then
arrive split the same way, and inputs that broadcast it (size 1 or missing) arrive replicated over
that axis (the insertion pass makes their gradient sum over the axis).
"""

from __future__ import annotations

import operator

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from passes.layout import REPLICATED, Layout, moved, parts, split_dim, uneven_ok
from passes.rules.registry import Strategy, Unsupported, register, whole_along
from passes.nodes import arg, shape, tensor_inputs, val
from passes.rules.moe.expert_rows import rows_pointwise, rows_sum

aten = torch.ops.aten

POINTWISE = [
    aten.add, aten.sub, aten.mul, aten.div, aten.neg, aten.pow, aten.rsqrt, aten.sqrt, aten.exp,
    aten.log, aten.abs, aten.tanh, aten.sigmoid, aten.relu, aten.gelu, aten.silu, aten.erf, aten.cos,
    aten.sin, aten.dropout, aten.clone, aten.contiguous, aten.alias, aten.detach, aten.to,
    aten._to_copy, aten.type_as, aten.eq, aten.ne, aten.lt, aten.le, aten.gt, aten.ge, aten.where,
    aten.masked_fill, aten.maximum, aten.minimum, aten.clamp, aten.__and__, aten.__or__,
    aten.bitwise_and, aten.bitwise_or, aten.bitwise_not, aten.logical_not, aten.logical_and,
    aten.logical_or, aten.lift_fresh_copy, aten.reciprocal, aten.square, aten.rsub, aten.tril,
    aten.triu, aten.zeros_like, aten.ones_like, aten.full_like, aten.softplus,
    aten.leaky_relu, aten.hardtanh, aten.elu, aten.mish, aten.sign, aten.floor, aten.ceil, aten.round,
    aten.min.other, aten.max.other, aten.isnan, aten.isinf,
    aten.logical_xor, aten.bitwise_xor, aten.remainder, aten.fmod, aten.log1p, aten.expm1, aten.erfinv,
    aten.log2, aten.atan,
]


def dim_map(in_shape, out_shape) -> dict:
    """Input dim -> output dim for right-aligned broadcasting; broadcast (size-1) dims are left out."""
    off = len(out_shape) - len(in_shape)
    return {d: d + off for d in range(len(in_shape)) if in_shape[d] == out_shape[d + off]}


# tensor operands that give only a dtype or device (x.type_as(other), x.to(other)): any shape, any
# layout; they are no inputs of the elementwise computation and are read where they are
_DTYPE_ONLY = {aten.type_as.default: 1, aten.to.other: 1}


def data_inputs(node) -> list:
    """The tensor inputs whose values the op reads (all but a dtype-only operand)."""
    skip = _DTYPE_ONLY.get(node.target)
    other = arg(node, skip, "other") if skip is not None else None
    return [n for n in tensor_inputs(node) if n is not other]


def broadcast_strategy(node, layouts, out_shape, mesh, skip_dims=()) -> tuple:
    """(input layouts, output layout) for an elementwise op over `out_shape`.

    `skip_dims` are output dims that must stay whole (e.g. the last dim of tril).
    """
    ins = data_inputs(node)
    out_ps, kinds = [], []
    for axis in range(2):
        chosen, kind = None, Shard(0)
        for n in ins:
            lay = layouts.get(n)
            p = lay[axis] if lay is not None else None
            d = None if p is None else split_dim(p)
            if d is not None:
                od = dim_map(shape(n), out_shape).get(d % len(shape(n)))
                free = od is not None and od not in skip_dims and od not in out_ps
                # a dim the axis does not divide keeps its torch.chunk blocks elementwise
                uneven = uneven_ok(mesh) and parts(p) == 1 and od is not None and \
                    shape(n)[d % len(shape(n))] == out_shape[od]
                if free and (out_shape[od] % (mesh[axis] * parts(p)) == 0 or uneven):
                    chosen, kind = od, p
                    break
        # a partial input is reduce-scattered onto the first divisible dim it has, unless it is a
        # statistic per token (last dim 1: a norm's mean square): all-reduced, one call for the two
        # that a reduce-scatter and the gather of its consumer would take, the same bytes
        if chosen is None and out_shape and out_shape[-1] != 1:
            full_dims = {od for n in ins if layouts.get(n) is not None and isinstance(layouts[n][axis], Partial)
                         for od in dim_map(shape(n), out_shape).values()}
            open_dims = [od for od in sorted(full_dims) if od not in skip_dims and od not in out_ps
                         and od != len(out_shape) - 1]
            chosen = next((od for od in open_dims if out_shape[od] % mesh[axis] == 0), None)
            if chosen is None and open_dims and uneven_ok(mesh):  # none divisible: torch.chunk blocks of the first
                chosen = open_dims[0]
        out_ps.append(chosen)
        kinds.append(kind)
    out = Layout(tuple(moved(k, d) if d is not None else Replicate() for d, k in zip(out_ps, kinds)))
    req = {}
    for n in ins:
        m = {o: i for i, o in dim_map(shape(n), out_shape).items()}
        req[n] = Layout(tuple(moved(k, m[d]) if d in m else Replicate() for d, k in zip(out_ps, kinds)))
    return req, out


# ops linear in their one tensor input: a partial sum stays a partial sum through them
_LINEAR_UNARY = {aten.to, aten._to_copy, aten.clone, aten.contiguous, aten.alias, aten.detach, aten.neg,
                 aten.lift_fresh_copy}
_SUMS = {aten.add.Tensor, aten.sub.Tensor}


def _keeps_partial(node, layouts, axis) -> bool:
    ins = data_inputs(node)
    ps = [layouts[n][axis] if layouts.get(n) is not None else None for n in ins]
    if not ps or not all(isinstance(p, Partial) and p.reduce_op == "sum" for p in ps):
        return False
    if getattr(node.target, "overloadpacket", None) in _LINEAR_UNARY:
        # a widening cast (bf16 -> fp32: the RMSNorm of transformers' models) reduces first, in the narrow
        # dtype: the collective then moves half the bytes, as Megatron's reduce-scatter of bf16 does
        return len(ins) == 1 and val(node).element_size() <= val(ins[0]).element_size()
    return node.target in _SUMS and all(isinstance(a, torch.fx.Node) for a in node.args[:2])


@register(*POINTWISE)
def pointwise(node, layouts, mesh):
    out = val(node)
    if not isinstance(out, torch.Tensor):
        raise Unsupported("non-tensor output")
    skip = (out.dim() - 1, out.dim() - 2) if node.target in (aten.tril.default, aten.triu.default) else ()
    rows = rows_pointwise(node, layouts, data_inputs(node),
                          lambda lays: broadcast_strategy(node, lays, tuple(out.shape), mesh, skip))
    if rows is not None:  # an expert matmul's P(rows) result through act(gate) * up
        return rows
    req, lay = broadcast_strategy(node, layouts, tuple(out.shape), mesh, skip)
    for axis in range(2):  # sums of partial sums, and casts/copies of one, stay partial
        if _keeps_partial(node, layouts, axis):
            lay = lay.with_axis(axis, Partial("sum"))
            req = {n: r.with_axis(axis, Partial("sum")) for n, r in req.items()}
    return Strategy(req, lay)


@register(operator.getitem)
def getitem(node, layouts, mesh):
    """One piece of a multi-output op (split, unbind, ...), laid out as that op's rule said. The tuple
    is not listed as an input: it always arrives as it is, and is no tensor to redistribute."""
    src, idx = node.args[0], node.args[1]
    lay = layouts[src]
    return Strategy({}, lay[idx] if isinstance(lay, tuple) else lay)


def _reduced_dims(node) -> tuple:
    x = node.args[0]
    nd = len(shape(x))
    dims = arg(node, 1, "dim")
    if dims is None or dims == []:
        return tuple(range(nd))
    dims = [dims] if isinstance(dims, int) else dims
    return tuple(sorted(d % nd for d in dims))


@register(aten.sum.dim_IntList, aten.mean.dim, aten.sum.default, aten.mean.default)
def reduction(node, layouts, mesh):
    """A split reduced dim gives a partial result over its axis (sum, or avg for mean)."""
    x = node.args[0]
    lay = layouts[x]
    kind = "avg" if node.target in (aten.mean.dim, aten.mean.default) else "sum"
    summed = rows_sum(lay, kind)  # the experts' results summed over the top-k: reduced later, once
    if lay is None or lay.has_partial:
        lay = REPLICATED if lay is None else lay
        lay = Layout(tuple(Replicate() if isinstance(p, Partial) and a not in summed else p
                           for a, p in enumerate(lay.placements)))
    lay = lay.normalized(len(shape(x)))
    dims = _reduced_dims(node)
    keep = arg(node, 2, "keepdim", False)
    if kind == "avg":  # the mean of unequal torch.chunk blocks' means is not the mean: reduce it whole
        xs = shape(x)
        lay = Layout(tuple(Replicate() if split_dim(p) in dims and xs[p.dim] % mesh[a] else p
                           for a, p in enumerate(lay.placements)))
    out = []
    for a, p in enumerate(lay.placements):
        if a in summed:
            out.append(summed[a])
        elif split_dim(p) is None:
            out.append(p)
        elif p.dim in dims:
            out.append(Partial(kind))
        else:
            out.append(moved(p, p.dim if keep else p.dim - sum(d < p.dim for d in dims)))
    return Strategy({x: lay}, Layout(tuple(out)))


@register(aten.softmax.int, aten._softmax.default, aten.log_softmax.int, aten._log_softmax.default,
          aten.cumsum.default)
def along_dim(node, layouts, mesh):
    """Ops that mix values along one dim: that dim must be whole, the others stay as they are."""
    x = node.args[0]
    lay = whole_along(layouts, x, node.args[1] % len(shape(x)))
    return Strategy({x: lay}, lay)


@register(aten.topk.default, aten.sort.default, aten.sort.stable)
def select_along(node, layouts, mesh):
    """topk and sort (a router picking its experts): the values and indices along one dim, which must
    be whole; the other dims stay split as they are (each token picks on its own row)."""
    x = node.args[0]
    if node.target == aten.topk.default:
        dim = arg(node, 2, "dim", -1)
    elif node.target == aten.sort.default:
        dim = arg(node, 1, "dim", -1)
    else:
        dim = node.kwargs.get("dim", -1)
    lay = whole_along(layouts, x, dim % len(shape(x)))
    return Strategy({x: lay}, (lay, lay))
