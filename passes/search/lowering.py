"""Each SUMMA product's lowering for a fixed strategy: the one its estimate prices faster.

`lowering='auto'` (the default option) lets every product choose between the broadcast lowering (one
block in flight, R + C - gcd(R, C) calls per mesh axis, transfers overlapped with the matmuls) and the
all-gather lowering (one call per axis; q|k|v and gate|up share theirs), by the alpha-beta estimate of
`passes.search.estimate`: alpha per launch against the broadcast lowering's overlap. `strategy='auto'`
makes the same choice inside its search (`strategy.choose`); this module makes it for '2d' and '1d'.
Runs on the captured graph before propagation and leaves `LOWERING` (`passes.meta`) on the SUMMA nodes,
which the insertion pass reads.
"""

from __future__ import annotations

from torch.fx import GraphModule

from passes.cost.model import CostModel
from passes.meta import CHOICE, LOWERING
from passes.options import Options
from passes.search.strategy import Evaluator, block_lowerings, find_units, fixed_assignment

__all__ = ["fixed_estimate", "pick_lowerings"]


def fixed_estimate(gm: GraphModule, mesh, cm: CostModel, strategy: str, options: Options) -> tuple:
    """(Estimate, SUMMA or 3D node name -> the lowering it prices faster) of the fixed `strategy` ("2d",
    "1d", or "3d" on a cube's (q, q*q) grid) on `gm`. The strategy's own marks (`CHOICE`) are left as
    they were: the estimate sets its own while it prices."""
    units = find_units(gm)
    before = {n: n.meta.get(CHOICE) for u in units for n in u.nodes}
    ev = Evaluator(gm, mesh, cm, units, options)
    est = ev.estimate(fixed_assignment(units, strategy))
    lowerings = block_lowerings(ev, est)
    for n, choice in before.items():
        if choice is None:
            n.meta.pop(CHOICE, None)
        else:
            n.meta[CHOICE] = choice
    return est, lowerings


def pick_lowerings(gm: GraphModule, mesh, cm: CostModel, strategy: str, options: Options) -> dict:
    """Mark every SUMMA and 3D node of `gm` under the fixed `strategy` ("2d", "1d" or "3d") with the lowering its
    estimate prices faster and return them, node name -> lowering."""
    _, lowerings = fixed_estimate(gm, mesh, cm, strategy, options)
    for node in gm.graph.nodes:
        if node.name in lowerings:
            node.meta[LOWERING] = lowerings[node.name]
    return lowerings
