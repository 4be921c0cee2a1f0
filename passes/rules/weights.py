"""Which matmul operands are weights: a parameter or a transpose of one, and how many fused parts
(q|k|v, gate|up) a projection's output is split into. Shared by the matmul and the expert rules."""

from __future__ import annotations

import torch
from torch.distributed.tensor import Shard

from passes.layout import Layout
from passes.meta import ROLE
from passes.nodes import arg, shape, val
from passes.rules.views import TRANSPOSES, VIEWS, is_cast

aten = torch.ops.aten

_SPLITS = (aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default)


def fused_parts(node) -> int:
    """k when the matmul's output (through views that keep its last dim) is split along the last dim
    into k > 1 equal parts -- a fused q|k|v or gate|up projection -- else 1."""
    n_out = val(node).shape[-1]
    frontier = [node]
    while frontier:
        n = frontier.pop()
        for u in n.users:
            if u.op != "call_function":
                continue
            if u.target in VIEWS and val(u).shape[-1] == n_out:
                frontier.append(u)
            elif u.target in _SPLITS:
                nd = len(val(n).shape)
                dim = arg(u, 2, "dim", 0) % nd
                pieces = val(u)
                if dim == nd - 1 and len(pieces) > 1 and len({t.shape[dim] for t in pieces}) == 1:
                    return len(pieces)
    return 1


def is_param(w) -> bool:
    """w is a parameter, or a transpose of one."""
    while w.op == "call_function" and w.target in TRANSPOSES:
        w = w.args[0]
    return w.op == "placeholder" and w.meta.get(ROLE) == "param"


def whole_experts_why(w, experts: int, rows: int, placed: Layout | None) -> str:
    """Why the experts of weight `w` stay whole over the `rows` mesh rows, as a fallback's note says
    it: the weight arrives whole (computed by an op that ran whole, such as a scale, or placed so by
    an earlier use or compile: the op is named), or the rows do not divide the expert count and
    uneven splits are off."""
    head = "fallback: experts whole over the rows: "
    if placed is not None and placed.normalized(len(shape(w)))[0] != Shard(0):
        src = w
        while src.op == "call_function" and (src.target in TRANSPOSES or is_cast(src)):
            src = src.args[0]
        made = f"{src.name} ({src.target})" if src.op == "call_function" else src.name
        return (f"{head}the weight {w.name} arrives whole over the rows from {made}, which runs whole or was "
                f"placed so by an earlier use or compile; apply such an op to the product's output instead "
                f"of the weight to split the experts")
    return f"{head}{experts} experts on {rows} rows; pass indivisible='uneven' to split them in unequal blocks"
