"""The placement `P(rows)` of the expert matmuls' results (see `passes.rules.moe.experts`), and how
elementwise ops carry it.

`P(rows)` is a partial sum over the grid's rows axis whose summands have disjoint rows: member r holds
the rows of the tokens routed to its experts and zeros elsewhere, so the sum over the axis is the
whole tensor and each row comes from one member. An elementwise op keeps it when it maps 0 to 0 on
its one tensor input (activations, casts, a scalar factor), or when it is a product whose other
factors are `P(rows)` too (the same rows) or whole over the axis: the other rows stay zero and the
sum is still the result. Any other consumer gets it reduced like any partial sum.

>>> Layout((EXPERT_ROWS, Partial("sum"))), EXPERT_ROWS == Partial("sum")
(P(rows)P(sum), False)
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.fx import Node

from passes.layout import Layout
from passes.rules.registry import Strategy

aten = torch.ops.aten
# a partial sum over the rows axis whose summands have disjoint rows (see the module docstring)
EXPERT_ROWS = Partial("rows")
# ops with f(0) = 0 on their one tensor input: the zero rows of a P(rows) tensor stay zero
ZERO_KEEPING = {aten.silu, aten.gelu, aten.relu, aten.tanh, aten.neg, aten.to, aten._to_copy, aten.clone,
                 aten.contiguous, aten.alias, aten.detach, aten.square, aten.sin, aten.erf, aten.abs, aten.elu,
                 aten.mish, aten.leaky_relu, aten.mul, aten.div}


def _keeps_rows(node: Node, ins: list, lays: list, axis: int) -> bool:
    """Whether an elementwise op keeps P(rows) over `axis`: one input (or a scalar factor) and f(0) = 0,
    or a product whose other factors are P(rows) or whole over the axis."""
    packet = getattr(node.target, "overloadpacket", None)
    rows = [lay is not None and lay[axis] == EXPERT_ROWS for lay in lays]
    if not any(rows) or packet not in ZERO_KEEPING:
        return False
    if len(ins) == 1:
        return True
    others = [lay for lay, r in zip(lays, rows) if not r]
    return packet == aten.mul and all(lay is None or isinstance(lay[axis], Replicate) for lay in others)


def rows_pointwise(node: Node, layouts: dict, ins: list, broadcast) -> Strategy | None:
    """The elementwise strategy when an input is P(rows) over an axis that the op keeps so; None when
    none is (the op's usual rule then reduces it). `broadcast(layouts)` is the usual (inputs, output)
    rule, run with P(rows) read as whole to place the other axis."""
    lays = [layouts.get(n) for n in ins]
    keep = [a for a in range(2) if _keeps_rows(node, ins, lays, a)]
    if not keep:
        return None
    plain = dict(layouts)
    for n, lay in zip(ins, lays):
        if lay is not None:
            plain[n] = Layout(tuple(Replicate() if p == EXPERT_ROWS else p for p in lay.placements))
    summed = [a for a in range(2) if a not in keep and _scales_partial(node, lays, a)]
    for a in summed:  # the down projection's column sums, times the routing weights
        plain = {n: (Layout(lay.placements[:a] + (Replicate(),) + lay.placements[a + 1:]) if n in ins and lay
                     else lay) for n, lay in plain.items()}
    req, out = broadcast(plain)
    for a in keep + summed:
        out = out.with_axis(a, EXPERT_ROWS if a in keep else Partial("sum"))
        req = {n: r.with_axis(a, layouts[n][a] if layouts.get(n) is not None else Replicate())
               for n, r in req.items()}
    return Strategy(req, out)


def _scales_partial(node: Node, lays: list, axis: int) -> bool:
    """A product of one partial sum over `axis` with factors whole over it: still a partial sum."""
    partial = [lay is not None and lay[axis] == Partial("sum") for lay in lays]
    return getattr(node.target, "overloadpacket", None) == aten.mul and sum(partial) == 1 and all(
        lay is None or isinstance(lay[axis], Replicate) for lay, p in zip(lays, partial) if not p)


def rows_index(x: Node, lay: Layout | None, indexed: list) -> Layout | None:
    """x[idx] of a tensor that is P(rows) over an axis, the index tensors whole, no split dim indexed:
    a gather of rows keeps each element on at most one member (still P(rows)) and is linear (a partial
    sum over the other axis stays one). None when x is not such a tensor."""
    if lay is None or EXPERT_ROWS not in lay.placements:
        return None
    if any(p.dim in indexed for p in lay.placements if isinstance(p, Shard)):
        return None
    return lay if all(isinstance(p, (Partial, Replicate)) for p in lay.placements) else None


def rows_sum(lay: Layout | None, kind: str) -> dict:
    """{axis: placement of the result} for the partial axes a sum over dims keeps: P(rows) becomes a
    plain partial sum (rows of different members are added), a partial sum stays one."""
    if lay is None or kind != "sum" or EXPERT_ROWS not in lay.placements:
        return {}
    return {a: Partial("sum") for a, p in enumerate(lay.placements) if p in (EXPERT_ROWS, Partial("sum"))}

