"""histc (transformers' MoE code counting the tokens each expert gets): counts of a split input.

A histogram is a sum over the input's elements, so a block's histogram is its share of the whole
one: over a mesh axis that splits the input (any dim, even in unequal torch.chunk blocks) the counts
are `Partial("sum")`, summed by one all-reduce of `bins` values where a consumer needs them whole
(inserted and counted like every other collective). A partial input is not a sum of histograms: it is
made whole first. Integer inputs run as `passes.ops.histogram.LocalHistc`, which counts them on the
CPU too (torch has no CPU kernel for an integer histc).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch.distributed.tensor import Partial, Replicate

from passes.kernels.spec import KernelSpec
from passes.layout import REPLICATED, Layout, split_dim
from passes.ops.histogram import LocalHistc
from passes.rules.registry import Strategy, register
from passes.nodes import arg, shape, val

aten = torch.ops.aten


@dataclass(frozen=True)
class HistcSpec(KernelSpec):
    """histc of this rank's block, integers included (`LocalHistc`): no communication of its own."""

    name: ClassVar[str] = "histc"
    local: ClassVar[bool] = True
    bins: int = 100
    lo: float = 0.0
    hi: float = 0.0

    def operands(self, node):
        return (node.args[0],)

    def build(self, node, grid, lowering):
        return LocalHistc(self.bins, self.lo, self.hi), self.operands(node)

    def describe(self, site):
        return f"histc of the local block, {self.bins} bins"


@register(aten.histc.default)
def histc(node, layouts, mesh):
    x = node.args[0]
    lay = (layouts.get(x) or REPLICATED).normalized(len(shape(x)))
    lay = Layout(tuple(Replicate() if isinstance(p, Partial) else p for p in lay.placements))
    out = Layout(tuple(Replicate() if split_dim(p) is None else Partial("sum") for p in lay.placements))
    spec = None
    if not val(x).is_floating_point():
        spec = HistcSpec(bins=arg(node, 1, "bins", 100), lo=arg(node, 2, "min", 0), hi=arg(node, 3, "max", 0))
    return Strategy({x: lay}, out, kernel=spec, note="histc of the local block" if out.has_partial else "")
