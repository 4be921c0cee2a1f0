"""The global gradient norm of a parallel model, and clipping to it: `ParallelModule.clip_grad_norm_`."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from autopar.parallel.sharded import is_sharded
from passes.ops import comm

__all__ = ["clip_grad_norm"]


def clip_grad_norm(pmodel, max_norm: float, norm_type: float = 2.0, sharded: bool | None = None,
                   uncounted: frozenset = frozenset()) -> torch.Tensor:
    """Clip every gradient of `pmodel` to a total norm of `max_norm` (see `ParallelModule.clip_grad_norm_`).
    `sharded`: whether its replicas hold their grid blocks split (default: `is_sharded(pmodel)`); a
    pipelined model's stages say it for it. `uncounted`: ids of parameters clipped but not counted in the
    norm (a pipeline's second copy of a weight tied across stages)."""
    norm_type = float(norm_type)
    grid = pmodel.grid
    params = [p for p in pmodel.parameters() if p.grad is not None]
    grads = [p.grad for p in params]
    if not grads:
        return torch.zeros((), device=grid.device)
    local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    counted = [_counts_here(grid, g) and id(p) not in uncounted for p, g in zip(params, grads)]
    # sharded replicas hold different pieces of every gradient: the norm sums over all dp*R*C ranks
    sharded = is_sharded(pmodel) if sharded is None else sharded
    group = None if sharded else grid.world_group
    dev = local[0].device
    if norm_type == float("inf"):
        part = torch.stack([t.detach().abs().max().float() if c and t.numel() else torch.zeros((), device=dev)
                            for t, c in zip(local, counted)]).max()
        op = dist.ReduceOp.MAX
    else:
        part = torch.stack([t.detach().float().abs().pow(norm_type).sum() if c else torch.zeros((), device=dev)
                            for t, c in zip(local, counted)]).sum().double()
        op = dist.ReduceOp.SUM
    with comm.guarded(grid, "all-reduce", "grid", "clip_grad_norm_"):
        dist.all_reduce(part, op=op, group=group)
        if getattr(grid, "pp_group", None) is not None and not sharded:  # every stage's part (sharded: WORLD has)
            dist.all_reduce(part, op=op, group=grid.pp_group)
    total = part if norm_type == float("inf") else part.pow(1.0 / norm_type)
    total = total.float()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for t in local:
        t.detach().mul_(coef.to(t.dtype))
    return total


def _counts_here(grid, g) -> bool:
    """Whether this rank's block of gradient `g` enters the norm: a block replicated over a mesh axis
    counts on member 0 of that axis only (the replica axis of sharded replicas included)."""
    if not isinstance(g, DTensor):
        return grid.r == 0 and grid.c == 0
    where = {"dp": grid.dp_index, "r": grid.r, "c": grid.c}
    names = g.device_mesh.mesh_dim_names or ("r", "c")
    # not p.is_shard(): FSDP2's _StridedShard over the replicas is a split, and is_shard() says False
    return all(not p.is_replicate() or where[name] == 0 for name, p in zip(names, g.placements))
