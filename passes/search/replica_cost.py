"""What a grid's data-parallel replicas (grid=(dp, R, C)) add to a step's estimate: the memory of the
parameters, gradients and optimizer states as the replicas hold them, and the time of the
collectives over the replica axis that computation does not hide.

Memory, per byte of trained parameter block, at the step's peak:

    replicate   the block, its gradient and the optimizer's S states: 2 + S
    shard       1/dp of each (FSDP2, `autopar.parallel.sharded`): (2 + S)/dp, plus what is gathered at
                once: the parameters, their unsharded gradients and the reduce-scatter's copy, 3 g,
                where g is the share of the parameter bytes gathered at once: the root unit's and two
                repeated blocks' (the one running, the one prefetched) with reshard_after_forward,
                all of them without

Time: the replica axis has no entry of its own in the cost model; it is priced with the slower of the
grid's axes (axis 0 of the default model crosses nodes, as replicas usually do): a collective costs
alpha + bytes/beta. Replicated replicas all-reduce the gradients (2 (dp - 1)/dp of the trained block,
one call per `grad_bucket_mb` bucket) during backward; sharded ones all-gather every unit's parameters
((dp - 1)/dp of the block, twice for a block resharded after forward) and reduce-scatter its
gradients ((dp - 1)/dp of the trained block), one call each per unit. What overlaps is the forward's
third of the grid step for the forward's gathers and the backward's two thirds for the rest (FSDP2
prefetches the next unit; the buckets start as gradients complete); the first unit's (or bucket's)
transfer is never hidden.

>>> from passes.cost.model import CostModel
>>> from passes.options import Options
>>> cm = CostModel.resolve(None)
>>> rc = ReplicaCost(cm, Options(replicas=4, data_parallel="shard"), gathered=0.25, units=5, in_blocks=0.8)
>>> rc.factor  # 3 * 0.25 + (2 + 2) / 4
1.75
>>> rc.seconds(trained=2**30, params=2**30, step_s=10.0) < rc.seconds(trained=2**30, params=2**30, step_s=0.0)
True
"""

from __future__ import annotations

import math

from passes.cost.model import CostModel
from passes.meta import PARAM, ROLE
from passes.nodes import block_path
from passes.options import Options

__all__ = ["ReplicaCost", "gathered_share"]


def gathered_share(gm, reshard_after_forward: bool = True) -> tuple:
    """(share of the parameter bytes sharded replicas hold gathered at once, FSDP2 units, share of the
    parameter bytes in repeated blocks) for graph
    `gm`: the parameters under a repeated block's path (`model.layers.3.*`) form its unit, the others
    the root's; with `reshard_after_forward` the root and the two largest blocks are gathered at once,
    without it all of them."""
    sizes: dict = {}
    for n in gm.graph.find_nodes(op="placeholder"):
        v = n.meta.get("val")
        if n.meta.get(ROLE) != "param" or v is None:
            continue
        block = block_path(n.meta.get(PARAM, ""))
        sizes[block] = sizes.get(block, 0) + v.numel() * v.element_size()
    total = sum(sizes.values())
    blocks = sorted(b for k, b in sizes.items() if k is not None)
    in_blocks = sum(blocks) / total if total else 0.0
    if not total or not reshard_after_forward or not blocks:
        return 1.0, len(blocks) + 1, in_blocks
    return (sizes.get(None, 0) + sum(blocks[-2:])) / total, len(blocks) + 1, in_blocks


class ReplicaCost:
    """The replica axis of one graph's estimates (`passes.search.strategy.Evaluator`)."""

    def __init__(self, cm: CostModel, options: Options, gathered: float = 1.0, units: int = 1,
                 in_blocks: float = 0.0):
        self.options, self.units, self.in_blocks = options, units, in_blocks
        self.dp = options.replicas
        self.shard = options.data_parallel == "shard" and self.dp > 1
        states = options.optimizer_states
        self.factor = 3 * gathered + (2 + states) / self.dp if self.shard else 2 + states
        finite = [(b, a) for a, b in zip(cm.alpha, cm.beta) if b and math.isfinite(b)]
        self.beta: float = min(finite)[0] if finite else math.inf
        self.alpha: float = min(finite)[1] if finite else 0.0

    def _t(self, calls: float, nbytes: float) -> float:
        return calls * self.alpha + nbytes / self.beta

    def seconds(self, trained: float, params: float, step_s: float) -> float:
        """Time the replica axis adds to a training step whose grid part takes `step_s`, for a rank
        holding `params` bytes of parameter blocks, `trained` of them trained."""
        if self.dp == 1 or self.options.forward_only:
            return 0.0
        share = (self.dp - 1) / self.dp
        if not self.shard:
            bucket = self.options.grad_bucket_mb * 2**20
            calls = max(1, math.ceil(trained / bucket)) if bucket else max(1, self.units)
            t = self._t(calls, 2 * share * trained)
            return max(t - 2 * step_s / 3, t / calls)
        again = self.options.reshard_after_forward and self.units > 1
        blocks = params * self.in_blocks if again else 0.0  # gathered again for backward
        fwd = self._t(self.units, share * params)
        bwd = self._t(self.units + (self.units - 1) * again, share * (blocks + trained))
        return max(fwd - step_s / 3, fwd / self.units) + max(bwd - 2 * step_s / 3, bwd / self.units)
