"""The kernel spec of a 3D linear (`passes.ops.cube.CubeLinear`): how insertion builds it and what a
training step of it moves, per rank, on the cube's grid (q, q*q).

Its collectives, mapped onto the grid's two axes: the depth grid's column groups (., c, l) are the grid's
own (axis 0); its row groups (r, ., l) and the depth groups (r, c, .) lie inside the grid's rows (axis 1).
Per product the depth grid's SUMMA receives what `passes.cost.summa_blocks.product_elems` counts on a
q x q grid for the depth's slice of the contracted dim (K/q); the forward then reduce-scatters the
[M/q, N/q] partial sum over the depth, and backward all-gathers dY over it. The totals are
`passes.cost.cube.cube_linear_bytes`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import sympy
from torch.fx import Node

from passes.cost.planned import Cost
from passes.cost.summa_blocks import product_elems, step_products
from passes.cost.volumes import all_gather_bytes, reduce_scatter_bytes
from passes.kernels.spec import KernelSpec, Site, SummaSpec, products_per_step
from passes.meta import LOWERING
from passes.ops.cube import CubeLinear

__all__ = ["CubeSpec"]


@dataclass(frozen=True)
class CubeSpec(KernelSpec):
    """x [..., K] . W (+ bias) as a 3D linear; W stored [N, K] when `flip` (its block transposed first)."""

    x: Node
    w: Node
    bias: Node | None
    flip: bool
    name: ClassVar[str] = "cube"

    def operands(self, node: Node) -> tuple:
        return (self.x, self.w) + ((self.bias,) if self.bias is not None else ())

    def build(self, node, grid, lowering):
        return CubeLinear(grid, self.flip, node.name, node.meta.get(LOWERING, lowering)), self.operands(node)

    def values(self, site: Site) -> dict:
        x, y = site.val(0), site.node.meta["val"]
        return {"q": site.mesh[0], "e": y.element_size(), "M": math.prod(x.shape[:-1]), "K": x.shape[-1],
                "N": y.shape[-1]}

    def describe(self, site: Site) -> str:
        return "3D: SUMMA on the depth's K/q, reduce-scatter Y over depth; bwd all-gather dY, ABT + ATB"

    def steps(self, site, v, exact, lowering: str | None = None):
        """Per collective call: (grid axis, phase, bytes), for the depth grid's products one call per
        step and axis (the broadcast lowering: q; ring: q - 1 with traffic; all-gather: 1), the first
        carrying the product's bytes on that axis. `lowering`: the depth products' (default: the one
        the node runs or is marked with)."""
        q, e, M, K, N = (v[k] for k in ("q", "e", "M", "K", "N"))
        m, k_depth = M // q, K // q
        lowering = lowering or SummaSpec.lowering(site.node)
        calls = {"broadcast": q, "ring": q - 1, "allgather": 1}[lowering]
        roles = {"KN": (k_depth, N), "NK": (N, k_depth)}
        out = []
        grads = site.grads[:2]
        for phase, kind, dims in step_products(False, *grads):
            for axis, elems in product_elems(kind, lowering, (q, q), (0, 0), m, *roles[dims]):
                out += [(axis, phase, elems * e)] + [(axis, phase, 0)] * (calls - 1)
        out.append((1, "fwd", reduce_scatter_bytes(m * (N // q) * e, q)))
        if any(grads):
            out.append((1, "bwd", all_gather_bytes(m * (N // (q * q)) * e, q)))
        return out

    def lowering_terms(self, site: Site, lowering: str) -> list:
        """`terms` (axis, bytes, launches) with the depth products in `lowering`: what the estimate
        compares to choose one."""
        return [(a, b, 1) for a, _, b in self.steps(site, self.values(site), False, lowering) if site.mesh[a] > 1]

    def cost(self, site: Site) -> Cost:
        """The bytes as numbers (the steps' sums): with both gradients they are e(q-1)(MK + KN + MN)/q^3
        forward and e(q-1)(2MK + 2KN + MN)/q^3 backward (`passes.cost.cube.cube_linear_bytes`)."""
        steps = self.steps(site, self.values(site), exact=False)
        fwd, bwd = (sum(b for _, ph, b in steps if ph == phase) for phase in ("fwd", "bwd"))
        return Cost(self.describe(site), sympy.Integer(fwd), sympy.Integer(bwd), {})

    def flops(self, site: Site) -> int:
        v = self.values(site)
        q = v["q"]
        return 2 * (v["M"] // q) * (v["K"] // q) * (v["N"] // q) * products_per_step(*site.grads[:2])
