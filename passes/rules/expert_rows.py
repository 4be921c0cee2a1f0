"""The placement `P(rows)` of the expert matmuls' results (see `passes.rules.experts`), and how
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
from torch.distributed.tensor import Partial, Replicate
from torch.fx import Node

from passes.layout import Layout
from passes.rules import Strategy

aten = torch.ops.aten
# a partial sum over the rows axis whose summands have disjoint rows (see the module docstring)
EXPERT_ROWS = Partial("rows")
# ops with f(0) = 0 on their one tensor input: the zero rows of a P(rows) tensor stay zero
_ZERO_KEEPING = {aten.silu, aten.gelu, aten.relu, aten.tanh, aten.neg, aten.to, aten._to_copy, aten.clone,
                 aten.contiguous, aten.alias, aten.detach, aten.square, aten.sin, aten.erf, aten.abs, aten.elu,
                 aten.mish, aten.leaky_relu, aten.mul, aten.div}


def _keeps_rows(node: Node, ins: list, lays: list, axis: int) -> bool:
    """Whether an elementwise op keeps P(rows) over `axis`: one input (or a scalar factor) and f(0) = 0,
    or a product whose other factors are P(rows) or whole over the axis."""
    packet = getattr(node.target, "overloadpacket", None)
    rows = [lay is not None and lay[axis] == EXPERT_ROWS for lay in lays]
    if not any(rows) or packet not in _ZERO_KEEPING:
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
    req, out = broadcast(plain)
    for a in keep:
        out = out.with_axis(a, EXPERT_ROWS)
        req = {n: r.with_axis(a, layouts[n][a] if layouts.get(n) is not None else Replicate())
               for n, r in req.items()}
    return Strategy(req, out)
