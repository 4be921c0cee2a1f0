"""The replica axis of a plan: `autopar.plan(model, grid=(dp, R, C), data_parallel=...)`.

A plan prices one R x C grid (`autopar.planning.plan`); with dp > 1 replicas of it each rank also
averages the gradients over the replicas. With data_parallel='replicate' that is one all-reduce per
bucket of gradient blocks (`passes.ops.grad_buckets`, buckets of `grad_bucket_mb`), and a rank holds
its grid block of every parameter, gradient and AdamW state. With 'shard' (FSDP2,
`autopar.parallel.sharded`, priced by `passes.cost.replicas`) each FSDP2 unit (every repeated block,
and the root) all-gathers its parameters (a block twice, with reshard_after_forward) and
reduce-scatters its gradients per step, and a rank holds 1/dp of its block (FSDP2 pads each
block's first dim to a multiple of dp). The figures are those a real run counts (tests/test_sharded.py
compares them on parallel models; this module prices a grid it has no processes for).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from passes.cost.replicas import fsdp_traffic, unit_groups
from passes.layout import REPLICATED, local_shape
from passes.ops.grad_buckets import BucketPlan
from passes.transforms.units import unit_blocks

__all__ = ["ReplicaPlan", "plan_replicas"]


@dataclass(frozen=True)
class ReplicaPlan:
    """Per rank and training step, what the replica axis of a (dp, R, C) grid moves and what a rank
    holds between steps."""

    dp: int
    data_parallel: str  # 'replicate' or 'shard'
    calls: int  # collective calls over the replicas
    received_bytes: int  # bytes those calls receive
    param_bytes: int  # parameter bytes a rank holds between steps (its grid block, or 1/dp of it)
    trained_bytes: int  # of those, the parameters that get a gradient (gradients and AdamW states alike)
    block_bytes: int  # its grid block of every parameter: what a step gathers with 'shard'
    units: int = 0  # with 'shard': FSDP2 units (the root and one per repeated block)
    gathered_bytes: int = 0  # with 'shard': most parameter block bytes gathered at once

    def state_bytes(self, optimizer_states: int = 2) -> int:
        """Parameters, gradients and `optimizer_states` tensors per trained parameter, held between steps."""
        return self.param_bytes + (1 + optimizer_states) * self.trained_bytes

    def to_json(self) -> dict:
        return {"dp": self.dp, "data_parallel": self.data_parallel, "calls_per_rank_per_step": self.calls,
                "received_bytes_per_rank_per_step": self.received_bytes, "param_bytes_held": self.param_bytes,
                "state_bytes_held_adamw": self.state_bytes(), "grid_block_bytes": self.block_bytes,
                **({"fsdp_units": self.units, "gathered_bytes_peak": self.gathered_bytes}
                   if self.data_parallel == "shard" else {})}


def plan_replicas(model, comp, layouts: dict, mesh: tuple, dp: int, data_parallel: str,
                  bucket_mb: float, reshard_after_forward: bool = True) -> ReplicaPlan:
    """The replica axis of `comp` (a Compiled program on the R x C `mesh`, rank (0, 0)'s blocks) over
    `dp` replicas, each parameter in its `layouts` entry; with 'shard', FSDP2 units as
    `autopar.parallel.sharded` makes them (each repeated block the program runs as one call, then the
    root)."""
    blocks = {}
    for name, p in model.named_parameters():
        shape = tuple(local_shape(tuple(p.shape), layouts.get(name, REPLICATED), mesh, at=(0, 0)))
        blocks[name] = (shape, p.element_size(), p.requires_grad, p.dtype)
    block = sum(math.prod(s) * e for s, e, _, _ in blocks.values())
    if data_parallel == "shard":
        units = [u for u in unit_blocks(comp.gm, comp.captured.sources)
                 if any(n.startswith(u + ".") for n in blocks)]
        t = fsdp_traffic(unit_groups({n: (s, e, g) for n, (s, e, g, _) in blocks.items()}, units), dp,
                         reshard_after_forward)
        return ReplicaPlan(dp, data_parallel, t.calls, t.received, t.shard_bytes, t.trained_shard_bytes, block,
                           t.units, t.gathered_bytes)
    trained = {n: torch.empty(s, dtype=dt, device="meta") for n, (s, _, g, dt) in blocks.items() if g}
    buckets = BucketPlan.build(comp.gm, comp.captured.sources, trained, bucket_mb * 2**20)
    return ReplicaPlan(dp, data_parallel, len(buckets.buckets), buckets.received(dp), block,
                       sum(t.numel() * t.element_size() for t in trained.values()), block)
