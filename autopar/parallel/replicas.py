"""What a ParallelModule's replica axis does around each program run: its replica mode.

- `Replicas`: one replica (grid=(R, C)), or the base of the others: runs the program as compiled.
- `Replicated` (grid=(dp, R, C), data_parallel='replicate'): each replica holds its grid blocks whole and
  the gradients are averaged over the replicas in buckets (`passes.ops.grad_buckets`), each bucket's
  all-reduce started during backward as soon as its gradients are complete. A pipeline stage turns `sync`
  off: its stages average once per step, after the schedule.
- `Sharded` (data_parallel='shard', `autopar.parallel.sharded`): FSDP2 splits the blocks over the replicas.

`ParallelModule.replicas` holds the mode; `shard_replicas` replaces it with a `Sharded` one.
"""

from __future__ import annotations

import contextlib

import torch

from passes.ops.grad_buckets import BucketPlan, BucketReduce, StepBuckets

__all__ = ["Replicas", "Replicated", "replicas_for"]


class Replicas:
    """One replica: nothing to gather before a program, nothing to average after it. The base of the modes
    (each overrides what its replicas do)."""


    def __init__(self, grid, options):
        self.grid, self.options = grid, options
        self.sync = True  # average the gradients over the replicas in each backward (Replicated)
        self._plans: dict = {}  # signature -> BucketPlan

    def program(self, comp) -> tuple:
        """(the program to run for `comp`, the parameter names it fetches itself): `comp` as compiled."""
        return comp, frozenset()

    def around(self, comp, run):
        """The context `run` (what `program` returned for `comp`) executes in."""
        return contextlib.nullcontext()

    def generating(self):
        """The context generation runs in."""
        return contextlib.nullcontext()

    def step(self, comp, pmodel, blocks: dict) -> StepBuckets | None:
        """This step's gradient buckets over the replicas (None: nothing to average here)."""
        return None

    def traffic(self):
        """What the replica axis moves per rank and training step (`Sharded`: FSDP2's); None otherwise."""
        return None

    def bucket_plan(self, comp, pmodel) -> BucketPlan:
        """How the gradients of `comp` are bucketed, one all-reduce per bucket (`passes.ops.grad_buckets`)."""
        plan = self._plans.get(comp.signature)
        if plan is None:
            blocks = {n: p.to_local() for n, p in pmodel.named_parameters() if p.requires_grad}
            plan = self._plans[comp.signature] = BucketPlan.build(
                comp.gm, comp.captured.sources, blocks, self.options.grad_bucket_mb * 2**20)
        return plan


class Replicated(Replicas):
    """grid=(dp, R, C), data_parallel='replicate' (see the module docstring)."""


    def step(self, comp, pmodel, blocks: dict) -> StepBuckets | None:
        """The parameter blocks in `blocks` (name -> block) replaced by their bucketed twins, whose gradients
        are all-reduced over the replicas as backward completes each bucket; None when nothing is trained
        (or `sync` is off, or grad mode is)."""
        if not (self.sync and torch.is_grad_enabled()):
            return None
        plan = self.bucket_plan(comp, pmodel)
        if not plan.buckets:
            return None
        step = StepBuckets(plan, self.grid, blocks[plan.keys[0]].device)
        for b, slots in enumerate(plan.buckets):
            outs = BucketReduce.apply(step, b, *(blocks[plan.keys[s]] for s in slots))
            blocks.update((plan.keys[s], o) for s, o in zip(slots, outs))
        return step


def replicas_for(grid, options) -> Replicas:
    """The mode a new ParallelModule starts in: `Replicated` over dp > 1 replicas, else one replica
    (data_parallel='shard' is applied after, by `autopar.parallel.sharded.shard_replicas`)."""
    return Replicated(grid, options) if grid.dp > 1 else Replicas(grid, options)
