"""Which matmul operands are weights: a parameter or a transpose of one, and how many fused parts
(q|k|v, gate|up) a projection's output is split into. Shared by the matmul and the expert rules."""

from __future__ import annotations

import torch

from passes.meta import ROLE
from passes.nodes import arg, val
from passes.rules.views import TRANSPOSES, VIEWS

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
