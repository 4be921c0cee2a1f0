"""Context parallelism at run time: the sequence split over cp ranks, attention over all of it.

With `context_parallel=cp` the grid's dp axis (`Grid.cp`, collectives over `passes.mesh.CP_AXIS`) holds cp
copies of the (R, C) grid that each compute on 1/cp of every sequence. The split is zig-zag: a sequence of S
tokens is cut into 2·cp chunks of S/(2cp) and rank i holds chunks i and 2cp−1−i, in that order, so that under a
causal mask every rank has the same number of (query, key) pairs: the early chunk sees few keys, the late one
many (the load balancing of Llama 3's and Megatron's context parallelism).

- `take` cuts a rank's part out of a whole tensor, `restore` puts the parts gathered in rank order back in
  sequence order, `positions` are the global token positions of a rank's part.
- `ContextAttention` replaces a `scaled_dot_product_attention` on the local tokens: it all-gathers the keys
  and values over the cp ranks (`comm.GatherSum`: the gradients of k and v reduce-scattered back in
  backward) and attends its own queries to every key, causal by global position. This is the all-gather
  flavour Llama 3 was trained with (arXiv:2407.21783, section 3.3.2); it holds the whole sequence's K and V
  (with grouped-query attention a few heads) and the [s/cp, s] mask.
- `SeqGather` gathers an output's sequence dim for the caller; `LossSum` makes the model's own mean loss,
  computed on each rank's tokens, the mean over the whole sequence on every rank.

The cp ranks average their gradients as replicas do (`passes.ops.grad_buckets`), so both functions scale the
gradient that enters a rank's program by cp: the average of cp shares is then their sum.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from passes.mesh import CP_AXIS, Grid
from passes.ops import comm

__all__ = ["ContextAttention", "LossSum", "SeqGather", "chunks", "positions", "restore", "take"]

TAG = "context"  # CommLog tag prefix of the context-parallel collectives


def chunks(i: int, cp: int) -> tuple:
    """The two chunks (of 2·cp) rank i of the cp ranks holds, in its order."""
    return i, 2 * cp - 1 - i


def take(x: torch.Tensor, dim: int, i: int, cp: int) -> torch.Tensor:
    """Rank i's part of `x`, whole along `dim` (its length divisible by 2·cp): chunks i and 2cp−1−i."""
    c = x.shape[dim] // (2 * cp)
    return torch.cat([x.narrow(dim, a * c, c) for a in chunks(i, cp)], dim)


def restore(g: torch.Tensor, dim: int, cp: int) -> torch.Tensor:
    """The parts of cp ranks concatenated along `dim` in rank order, back in sequence order."""
    order = [a for i in range(cp) for a in chunks(i, cp)]
    parts = g.chunk(2 * cp, dim)
    return torch.cat([parts[order.index(k)] for k in range(2 * cp)], dim)


def positions(i: int, cp: int, n: int, device=None) -> torch.Tensor:
    """The global positions of rank i's n tokens."""
    c = n // 2
    return torch.cat([torch.arange(a * c, (a + 1) * c, device=device) for a in chunks(i, cp)])


class ContextAttention(nn.Module):
    """Attention of this rank's queries [b, h, n, d] to the keys and values of all cp ranks (see the module
    docstring). `causal`: key j is seen by query i where j's global position is at most i's."""

    def __init__(self, grid: Grid, causal: bool, scale, gqa: bool, dropout_p: float, tag: str):
        super().__init__()
        self.grid, self.causal, self.scale, self.gqa, self.dropout_p, self.tag = \
            grid, causal, scale, gqa, dropout_p, tag
        self._masks: dict = {}

    def mask(self, n: int, device) -> torch.Tensor | None:
        """[n, cp·n] bool: which gathered keys (in rank order) each local query attends to; None: all."""
        if not self.causal:
            return None
        key = (n, str(device))
        if key not in self._masks:
            cp, i = self.grid.cp, self.grid.dp_index
            q = positions(i, cp, n, device)
            k = torch.cat([positions(j, cp, n, device) for j in range(cp)])
            self._masks[key] = k[None, :] <= q[:, None]
        return self._masks[key]

    def forward(self, q, k, v):
        keys = comm.GatherSum.apply(k, self.grid, CP_AXIS, 2, f"{TAG} {self.tag} k")
        values = comm.GatherSum.apply(v, self.grid, CP_AXIS, 2, f"{TAG} {self.tag} v")
        drop = self.dropout_p if self.training else 0.0
        extra = {"enable_gqa": True} if self.gqa else {}
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=self.mask(q.shape[2], q.device),
                                              dropout_p=drop, scale=self.scale, **extra)

    def extra_repr(self) -> str:
        return f"cp={self.grid.cp}, causal={self.causal}, all-gather of k and v"


class SeqGather(torch.autograd.Function):
    """An output's sequence dim (1) gathered over the cp ranks, in sequence order; backward: this rank's part
    of the gradient, times cp (the replicas' average of the cp parts is then their sum)."""

    @staticmethod
    def forward(ctx, x, grid, tag):
        ctx.grid = grid
        return restore(comm.all_gather(grid, CP_AXIS, x, 1, f"{TAG} {tag}", "fwd"), 1, grid.cp)

    @staticmethod
    def backward(ctx, g):
        grid = ctx.grid
        return take(g, 1, grid.dp_index, grid.cp) * grid.cp, None, None


class LossSum(torch.autograd.Function):
    """The model's mean loss over the sequence from each rank's mean over its own tokens: Σ_i w_i·loss_i
    over the cp ranks, w_i the rank's share of the counted targets (a rank that counts none adds 0, not its
    0/0). Backward: w_i·cp to this rank's loss (the replicas' average of the cp shares is then their sum)."""

    @staticmethod
    def forward(ctx, loss, share, grid):
        ctx.save_for_backward(share)
        ctx.cp = grid.cp
        mine = torch.where(share > 0, loss * share, torch.zeros_like(loss))
        return comm.all_reduce(grid, CP_AXIS, mine.detach().clone(), f"{TAG} loss", "fwd")

    @staticmethod
    def backward(ctx, g):
        (share,) = ctx.saved_tensors
        return torch.where(share > 0, g * share * ctx.cp, torch.zeros_like(g)), None, None
