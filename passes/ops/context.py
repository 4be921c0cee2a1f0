"""Context parallelism at run time: the sequence split over cp ranks, attention over all of it.

With `context_parallel=cp` the grid's dp axis (`Grid.cp`, collectives over `passes.mesh.CP_AXIS`) holds cp
copies of the (R, C) grid that each compute on 1/cp of every sequence. The split is zig-zag: a sequence of S
tokens is cut into 2·cp chunks of S/(2cp) and rank i holds chunks i and 2cp−1−i, in that order, so that under a
causal mask every rank has the same number of (query, key) pairs: the early chunk sees few keys, the late one
many (the load balancing of Llama 3's and Megatron's context parallelism).

- `take` cuts a rank's part out of a whole tensor, `restore` puts the parts gathered in rank order back in
  sequence order, `positions` are the global token positions of a rank's part.
- `ContextAttention` replaces a `scaled_dot_product_attention` on the local tokens, in one of three flavours
  (`context_attention`; 'auto' takes the all-to-all where it can run, else the ring):
  - **all-to-all** (DeepSpeed-Ulysses, arXiv:2309.14509), where this rank's query and KV heads both divide by
    cp: q, k and v go from sequence-split to head-split ([b, h/cp, S, d], every token in sequence order), the
    attention runs whole and causal with no mask (the fused kernels), and its output comes back; four
    all-to-alls forward, four backward, each receiving (cp−1)/cp of its tensor.
  - **ring** (`passes.ops.ring_attention`): K and V passed around the cp ranks block by block, each block's
    transfer beside the previous block's product, the softmax merged online; O(s/cp) saved per rank.
  - **all-gather** (the flavour Llama 3 was trained with, arXiv:2407.21783, section 3.3.2): k and v
    are all-gathered (`comm.GatherSum`: their gradients reduce-scattered back) and this rank's queries attend
    to every key under an [s/cp, s] mask by global position; it holds the whole sequence's K and V and that
    mask (which SDPA keeps for backward, in the queries' dtype, per attention).
- `SeqGather` gathers an output's sequence dim for the caller; `LossSum` makes the model's own mean loss,
  computed on each rank's tokens, the mean over the whole sequence on every rank.

The cp ranks average their gradients as replicas do (`passes.ops.grad_buckets`), so both functions scale the
gradient that enters a rank's program by cp: the average of cp shares is then their sum.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from passes.mesh import CP_AXIS, Grid
from passes.ops import comm
from passes.ops.ring_attention import RingAttention
from passes.cost.context import flavour
from passes.cost.volumes import all_to_all_bytes

__all__ = ["ContextAttention", "HeadExchange", "LossSum", "SeqGather", "chunks", "positions", "restore", "take"]

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


def _all_to_all(grid: Grid, parts: torch.Tensor, tag: str, phase: str) -> torch.Tensor:
    """parts[i] (dim 0: one per cp rank) sent to cp rank i; returns what each sent here, in rank order. Issued on
    fake tensors too (the dry run's fake process group counts and records it)."""
    out = torch.empty_like(parts)
    cp = grid.cp
    grid.log.add(tag, phase, all_to_all_bytes([1] * cp, grid.cp_index, parts[0].numel() * parts.element_size()))
    grid.log.launch(tag, phase)
    with comm.guarded(grid, "all-to-all", CP_AXIS, tag, parts):
        dist.all_to_all_single(out, parts.contiguous(), group=grid.group(CP_AXIS))
    return out


def _to_heads(x: torch.Tensor, grid: Grid, tag: str, phase: str) -> torch.Tensor:
    """[b, h, n, d] (this rank's tokens) -> [b, h/cp, S, d] (head group i of every token, in sequence order)."""
    cp, (b, h, n, d) = grid.cp, x.shape
    parts = x.reshape(b, cp, h // cp, n, d).transpose(0, 1).contiguous()  # [cp (head group), b, h/cp, n, d]
    got = _all_to_all(grid, parts, tag, phase)  # [cp (source rank), ...]
    return restore(got.permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * n, d), 2, cp)


def _to_tokens(y: torch.Tensor, grid: Grid, tag: str, phase: str) -> torch.Tensor:
    """`_to_heads` undone: [b, h/cp, S, d] -> [b, h, n, d]."""
    cp, (b, hg, s, d) = grid.cp, y.shape
    parts = torch.stack([take(y, 2, i, cp) for i in range(cp)])  # [cp (destination rank), b, h/cp, n, d]
    got = _all_to_all(grid, parts, tag, phase)  # [cp (head group), ...]
    return got.transpose(0, 1).reshape(b, cp * hg, s // cp, d)


class HeadExchange(torch.autograd.Function):
    """Sequence-split to head-split (`to_heads`) or back, an all-to-all over the cp ranks; backward the reverse."""

    @staticmethod
    def forward(ctx, x, grid, tag, to_heads: bool):
        ctx.args = (grid, tag, to_heads)
        return (_to_heads if to_heads else _to_tokens)(x, grid, tag, "fwd")

    @staticmethod
    def backward(ctx, g):
        grid, tag, to_heads = ctx.args
        return (_to_tokens if to_heads else _to_heads)(g, grid, tag, "bwd"), None, None, None


def _repeat_kv(q, k, v) -> tuple:
    """k and v with each KV head repeated for the query heads that read it (head h reads KV head h // g, as
    SDPA's enable_gqa does; done here: its fused kernels take no enable_gqa with a mask)."""
    if k.shape[1] == q.shape[1]:
        return k, v
    g = q.shape[1] // k.shape[1]
    return k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)


class ContextAttention(nn.Module):
    """Attention of this rank's queries [b, h, n, d] to the keys and values of all cp ranks (see the module
    docstring). `causal`: key j is seen by query i where j's global position is at most i's."""

    def __init__(self, grid: Grid, causal: bool, scale, dropout_p: float, tag: str, blocks: tuple = (),
                 want: str = "auto"):
        """`blocks`: (q's local shape, k's local shape, element bytes) as planned, for `explain`; `want`: the
        flavour asked for (`passes.cost.context.FLAVOURS` or 'auto')."""
        super().__init__()
        self.grid, self.causal, self.scale, self.dropout_p, self.tag = grid, causal, scale, dropout_p, tag
        self._masks: dict = {}
        self.blocks, self.want = blocks, want
        # 'alltoall', 'ring' or 'allgather': as planned, and as the last call ran
        self.flavour = flavour(blocks[0][1], blocks[1][1], grid.cp, want, dropout_p > 0) if blocks else ""

    def mask(self, n: int, device, ranks: range | None = None) -> torch.Tensor | None:
        """[n, len(ranks)·n] bool: which keys of `ranks` (all cp ranks by default; in rank order) each local query
        attends to; None: all."""
        if not self.causal:
            return None
        cp, i = self.grid.cp, self.grid.cp_index
        ranks = range(cp) if ranks is None else ranks
        key = (n, str(device), ranks)
        if key not in self._masks:
            q = positions(i, cp, n, device)
            k = torch.cat([positions(j, cp, n, device) for j in ranks])
            self._masks[key] = k[None, :] <= q[:, None]
        return self._masks[key]

    def forward(self, q, k, v):
        drop = self.dropout_p if self.training else 0.0
        tag = f"{TAG} {self.tag}"
        self.flavour = flavour(q.shape[1], k.shape[1], self.grid.cp, self.want, self.dropout_p > 0)
        if self.flavour == "ring":  # K/V around the cp ring, the next block in flight beside the current product
            i = self.grid.cp_index
            return RingAttention.apply(q, k, v, self.grid, self.mask(q.shape[2], q.device, range(i, i + 1)),
                                       self.scale, tag)
        if self.flavour == "alltoall":  # every token of h/cp heads: causal in sequence order, no mask
            qh, kh, vh = (HeadExchange.apply(t, self.grid, f"{tag} {w}", True) for t, w in ((q, "q"), (k, "k"),
                                                                                              (v, "v")))
            kh, vh = _repeat_kv(qh, kh, vh)
            y = F.scaled_dot_product_attention(qh, kh, vh, dropout_p=drop, is_causal=self.causal, scale=self.scale)
            return HeadExchange.apply(y, self.grid, f"{tag} out", False)
        keys = comm.GatherSum.apply(k, self.grid, CP_AXIS, 2, f"{tag} k")
        values = comm.GatherSum.apply(v, self.grid, CP_AXIS, 2, f"{tag} v")
        keys, values = _repeat_kv(q, keys, values)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=self.mask(q.shape[2], q.device),
                                              dropout_p=drop, scale=self.scale)

    def extra_repr(self) -> str:
        return f"cp={self.grid.cp}, causal={self.causal}, {self.flavour or self.want}"


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
        return take(g, 1, grid.cp_index, grid.cp) * grid.cp, None, None


class LossSum(torch.autograd.Function):
    """The model's mean loss over the sequence from each rank's mean over its own tokens: Σ_i w_i·loss_i
    over the cp ranks, w_i the rank's share of the counted targets (a rank that counts none adds 0, not its
    0/0). Backward: w_i·cp to this rank's loss (the replicas' average of the cp shares is then their sum)."""

    @staticmethod
    def forward(ctx, loss, share, grid):
        ctx.save_for_backward(share)
        ctx.cp = grid.cp
        mine = torch.where(share > 0, loss * share, torch.zeros_like(loss))
        return comm.all_reduce(grid, CP_AXIS, mine, f"{TAG} loss", "fwd")  # a new tensor

    @staticmethod
    def backward(ctx, g):
        (share,) = ctx.saved_tensors
        return torch.where(share > 0, g * share * ctx.cp, torch.zeros_like(g)), None, None
