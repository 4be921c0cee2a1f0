"""The runtime modules the insertion pass puts in the graph: redistributions and sharded kernels.

Each is a small nn.Module holding the grid and static facts (layouts, tags); `explain` reads those
facts. All communication goes through `passes.ops.comm`, so it is counted.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Partial, Replicate, Shard

from passes.layout import Layout, parts, split_dim
from passes.mesh import Grid
from passes.ops import comm
from passes.ops.summa import summa_matmul

HALF = (torch.float16, torch.bfloat16)


class Redistribute(nn.Module):
    """Move a tensor from layout `src` to `dst`: first gather the axes whose split changes, then
    split, reduce or reduce-scatter axis by axis (never two axes on one dim in between)."""

    def __init__(self, grid: Grid, src: Layout, dst: Layout, tag: str):
        super().__init__()
        self.grid, self.src, self.dst, self.tag = grid, src, dst, tag

    def forward(self, x):
        g, cur = self.grid, list(self.src.placements)
        for a in range(2):
            if split_dim(cur[a]) is not None and cur[a] != self.dst[a]:
                x = comm.Gather.apply(x, g, a, cur[a].dim, self.tag, parts(cur[a]))
                cur[a] = Replicate()
        for a in range(2):
            s, d = cur[a], self.dst[a]
            if s == d:
                continue
            if isinstance(s, Partial):
                avg = s.reduce_op == "avg"
                if isinstance(d, Shard) and parts(d) == 1:
                    x = comm.ReduceScatter.apply(x, g, a, d.dim, avg, self.tag)
                    continue
                x = comm.AllReduce.apply(x, g, a, avg, self.tag)
            if split_dim(d) is not None:
                x = comm.Split.apply(x, g, a, d.dim, self.tag, parts(d))
            elif isinstance(d, Partial):
                x = comm.ToPartial.apply(x, g, a, d.reduce_op == "avg")
        return x

    def extra_repr(self) -> str:
        return f"{self.src} -> {self.dst}"


class GradSync(nn.Module):
    """A replicated tensor used by split work: all-reduce its gradient over `axes` in backward."""

    def __init__(self, grid: Grid, axes: tuple, tag: str):
        super().__init__()
        self.grid, self.axes, self.tag = grid, axes, tag

    def forward(self, x):
        for a in self.axes:
            x = comm.GradSync.apply(x, self.grid, a, self.tag)
        return x

    def extra_repr(self) -> str:
        return f"axes={self.axes}"


class SummaLinear(nn.Module):
    """y = x W (+ b) with x [..., K/q] and a local weight block; see `passes.ops.summa`."""

    def __init__(self, grid: Grid, transposed: bool, flip: bool, tag: str, lowering: str):
        super().__init__()
        self.grid, self.transposed, self.flip, self.tag, self.lowering = grid, transposed, flip, tag, lowering

    def forward(self, x, w, b=None):
        w = w.t() if self.flip else w
        y = summa_matmul(self.grid, x, w, transposed=self.transposed, tag=self.tag, lowering=self.lowering)
        return y if b is None else y + b.to(y.dtype)

    def extra_repr(self) -> str:
        return f"{'ABT' if self.transposed else 'AB'}, lowering={self.lowering}"


class ShardedNorm(nn.Module):
    """LayerNorm (or RMSNorm) over a last dim split over the mesh columns."""

    def __init__(self, grid: Grid, n: int, eps, centered: bool, tag: str):
        super().__init__()
        self.grid, self.n, self.eps, self.centered, self.tag = grid, n, eps, centered, tag

    def _sum(self, t):
        return comm.SyncedSum.apply(t.sum(-1, keepdim=True), self.grid, 1, self.tag)

    def forward(self, x, w=None, b=None):
        dtype = x.dtype
        x = x.float() if dtype in HALF else x  # statistics in fp32, like torch's own norms
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        if self.centered:
            x = x - self._sum(x) / self.n
        y = (x * torch.rsqrt(self._sum(x * x) / self.n + eps)).to(dtype)
        if w is not None:
            y = y * w
        return y if b is None else y + b

    def extra_repr(self) -> str:
        return f"{'layer' if self.centered else 'rms'}, n={self.n}"


class VocabSplitEmbedding(nn.Module):
    """Lookup in a table whose vocab dim is split over `vocab_axis`: ids outside this rank's block
    give zero rows, so the result is a partial sum over that axis."""

    def __init__(self, grid: Grid, vocab_axis: int, padding_idx: int, tag: str):
        super().__init__()
        self.grid, self.vocab_axis, self.padding_idx, self.tag = grid, vocab_axis, padding_idx, tag

    def forward(self, table, ids):
        rows = table.shape[0]  # V/q
        start = self.grid.index(self.vocab_axis) * rows
        local = ids - start
        inside = (local >= 0) & (local < rows)
        pad = self.padding_idx - start if 0 <= self.padding_idx - start < rows else -1
        out = F.embedding(local.masked_fill(~inside, 0), table, padding_idx=None if pad < 0 else pad)
        return out * inside.unsqueeze(-1).to(out.dtype)  # [..., h/q], partial over vocab blocks


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z, target, grid, ignore_index, tag, vocab_split=True, reduce_sum=False):
        zf = z.float()  # [n/q, V/q] (or [n/q, V] when the vocabulary is whole)
        m = zf.max(-1).values
        if vocab_split:
            m = comm.all_reduce(grid, 1, m, tag, "fwd", op=dist.ReduceOp.MAX)  # [n/q]
        e = torch.exp(zf - m[:, None])
        rows = z.shape[1]
        local = target - grid.c * rows if vocab_split else target
        inside = (local >= 0) & (local < rows)
        picked = zf.gather(1, local.clamp(0, rows - 1)[:, None]).squeeze(1) * inside
        sums = torch.stack([e.sum(-1), picked])  # [2, n/q]
        if vocab_split:
            sums = comm.all_reduce(grid, 1, sums, tag, "fwd")
        valid = target != ignore_index
        per_token = (torch.log(sums[0]) + m - sums[1]) * valid
        tot = comm.all_reduce(grid, 0, torch.stack([per_token.sum(), valid.sum().to(zf.dtype)]), tag, "fwd")
        ctx.save_for_backward(e, sums[0], local, inside, valid, tot[1])
        ctx.dtype, ctx.reduce_sum = z.dtype, reduce_sum
        return tot[0] if reduce_sum else tot[0] / tot[1]  # fp32; the module casts

    @staticmethod
    def backward(ctx, g):
        e, sumexp, local, inside, valid, count = ctx.saved_tensors
        grad = e / sumexp[:, None]  # softmax, minus one at the target where this rank holds it
        rows = grad.shape[1]
        grad.scatter_add_(1, local.clamp(0, rows - 1)[:, None], -inside[:, None].to(grad.dtype))
        grad = grad * (valid[:, None].to(grad.dtype) * (g if ctx.reduce_sum else g / count))
        return grad.to(ctx.dtype), None, None, None, None, None, None


class VocabParallelCrossEntropy(nn.Module):
    """Mean (or sum) cross-entropy over logits [N, V] split rows over mesh rows and (if `vocab_split`) vocab over
    mesh columns; statistics all-reduced, full logits never gathered; backward local."""

    def __init__(self, grid: Grid, ignore_index: int, tag: str, vocab_split: bool = True, reduce_sum: bool = False):
        super().__init__()
        self.grid, self.ignore_index, self.tag = grid, ignore_index, tag
        self.vocab_split, self.reduce_sum = vocab_split, reduce_sum

    def forward(self, logits, target):
        loss = _VocabParallelCE.apply(logits, target, self.grid, self.ignore_index, self.tag, self.vocab_split,
                                      self.reduce_sum)
        # under autocast torch's cross_entropy runs (and returns) fp32; otherwise it keeps the logits' dtype
        return loss if torch.is_autocast_enabled(logits.device.type) else loss.to(logits.dtype)
