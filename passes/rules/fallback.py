"""The replicate fallback: gather every input whole, run the op on full tensors, split afterwards.

Always correct, never silent: `propagate` collects every fallback node with its module path and the
reason, `autopar.parallelize` warns once listing them, and `explain` shows the gathers they cost.
"""

from __future__ import annotations

import torch

from passes.layout import REPLICATED
from passes.rules.registry import Strategy, register
from passes.nodes import tensor_inputs, val

aten = torch.ops.aten


def fallback(node, reason: str) -> Strategy:
    out = val(node)
    output = tuple(REPLICATED for _ in out) if isinstance(out, (tuple, list)) else REPLICATED
    return Strategy({n: REPLICATED for n in tensor_inputs(node)}, output, fallback=True,
                    note=f"fallback: {reason}")


def creation(node) -> Strategy:
    """Ops with no tensor input (arange, zeros, full, ...) build the whole tensor on every rank."""
    return Strategy({}, REPLICATED)


@register(aten.new_ones, aten.new_zeros, aten.new_full, aten.new_empty, aten.scalar_tensor)
def creation_like(node, layouts, mesh) -> Strategy:
    """new_ones(x, size) and friends take only dtype and device from x: a whole tensor, x untouched."""
    return Strategy({}, REPLICATED)

