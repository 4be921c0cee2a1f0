"""The runtime modules the insertion pass puts in the graph: redistributions and sharded kernels.

Each is a small nn.Module holding the grid and static facts (layouts, tags); `explain` reads those
facts. All communication goes through `passes.ops.comm`, so it is counted.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from passes.cost.planned import redistribution
from passes.layout import Layout, chunk_range
from passes.mesh import Grid
from passes.ops import bounds, comm, reblock
from passes.ops.summa import summa_matmul

HALF = (torch.float16, torch.bfloat16)
# statistics per token in each all-reduce of a sharded norm, (forward calls, backward calls); see _ShardedNormFn
NORM_STATS = {True: ((1, 2), (2,)), False: ((1,), (1,))}  # centered (LayerNorm) / RMSNorm


def norm_stat_size(dtype: torch.dtype) -> int:
    """Bytes of one norm statistic for inputs of `dtype`: fp32 for half inputs, else the input's size."""
    return 4 if dtype in HALF else dtype.itemsize


class Redistribute(nn.Module):
    """Move a tensor from layout `src` to `dst` by the steps of `passes.cost.planned.redistribution`,
    the list the planner prices: first gather the axes whose split changes, then split, reduce or
    reduce-scatter axis by axis (never two axes on one dim in between)."""

    def __init__(self, grid: Grid, src: Layout, dst: Layout, tag: str, shape: tuple | None = None,
                 synced: tuple = ()):
        """`shape`: the tensor's global shape, which a gather of a dim the grid does not divide needs.
        `synced`: axes whose gather sums the gradient over the group in backward (`comm.GatherSum`,
        a GradSync folded in), instead of taking this member's block of a gradient already whole."""
        super().__init__()
        self.grid, self.src, self.dst, self.tag = grid, src, dst, tag
        self.shape, self.synced = shape, tuple(synced)
        # worked out once, as plain values: forward reads no placement objects, which torch.compile
        # cannot trace into
        self.steps = redistribution(src, dst)

    def forward(self, x):
        g = self.grid
        for kind, a, dim, k, avg in self.steps:
            if kind == "gather" and a in self.synced:
                x = comm.GatherSum.apply(x, g, a, dim, self.tag, None if self.shape is None else self.shape[dim])
            elif kind == "gather":
                x = comm.Gather.apply(x, g, a, dim, self.tag, k, None if self.shape is None else self.shape[dim])
            elif kind == "reduce-scatter":
                x = comm.ReduceScatter.apply(x, g, a, dim, avg, self.tag)
            elif kind == "all-reduce":
                x = comm.AllReduce.apply(x, g, a, avg, self.tag)
            elif kind == "split":
                x = comm.Split.apply(x, g, a, dim, self.tag, k)
            elif kind in ("regroup", "ungroup"):
                x = reblock.Regroup.apply(x, g, a, dim, k, kind == "ungroup", self.tag)
            else:  # to-partial
                x = comm.ToPartial.apply(x, g, a, avg)
        return x

    def extra_repr(self) -> str:
        return f"{self.src} -> {self.dst}" + (f", bwd reduce-scatter over axes {self.synced}" if self.synced else "")


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
    """y = x W (+ b) with x [..., K/q] and a local weight block; see `passes.ops.summa`. `rows_whole`:
    x is not split over the mesh rows (a batch they do not divide), every row computes all of it."""

    def __init__(self, grid: Grid, transposed: bool, flip: bool, tag: str, lowering: str, rows_whole: bool = False,
                 full: int | None = None):
        """`full`: the dim the SUMMA steps cut (K for AB, N for ABT) when the grid does not divide it."""
        super().__init__()
        self.grid, self.transposed, self.flip, self.tag, self.lowering = grid, transposed, flip, tag, lowering
        self.rows_whole, self.full = rows_whole, full

    def forward(self, x, w, b=None):
        w = w.t() if self.flip else w
        y = summa_matmul(self.grid, x, w, transposed=self.transposed, tag=self.tag, lowering=self.lowering,
                         rows_whole=self.rows_whole, full=self.full)
        return y if b is None else y + b.to(y.dtype)

    def extra_repr(self) -> str:
        whole = ", rows whole" if self.rows_whole else ""
        return f"{'ABT' if self.transposed else 'AB'}, lowering={self.lowering}{whole}"


def _row_sum(grid: Grid, t: torch.Tensor, tag: str, phase: str) -> torch.Tensor:
    """Sum over the whole hidden dim, of which this rank holds the slice t [..., h/C]: [...]."""
    return comm.all_reduce(grid, 1, t.sum(-1), tag, phase)


def _row_sums(grid: Grid, parts: list, tag: str, phase: str) -> torch.Tensor:
    """`_row_sum` of each of `parts` in one all-reduce: [len(parts), ...]."""
    return comm.all_reduce_stack(grid, 1, [t.sum(-1) for t in parts], tag, phase)


class _ShardedNormFn(torch.autograd.Function):
    """y = (x - mean) * rstd * w + b over a last dim split over the mesh columns (mean = 0 for RMS).

    Forward, LayerNorm: a first all-reduce gives a shift m0 = fp32 mean; the second sums x - m0 and
    (x - m0)^2 (shifted-data variance: x - m0 is exact for x near m0, so a mean offset far above the
    spread, e.g. 1e4 + noise, loses nothing, where an fp32 mean alone is off by half an ulp of 1e4).
    Backward in closed form from the saved mean and rstd, as torch's own norms: autograd through
    rsqrt would form var^-1.5, which underflows fp32 for |x| ~ 1e15 (var^-1.5 ~ 1e-45).
    Statistics in fp32 for half inputs (torch's opmath type), else in the input's dtype.
    """

    @staticmethod
    def forward(ctx, x, w, b, grid, n, eps, centered, tag):
        acc = torch.float32 if x.dtype in HALF else x.dtype
        xa = x.to(acc)  # [..., h/C]
        eps = eps if eps is not None else torch.finfo(acc).eps
        if centered:
            m0 = _row_sum(grid, xa, tag, "fwd") / n  # [...]
            xc = xa - m0[..., None]  # [..., h/C]
            s1, s2 = _row_sums(grid, [xc, xc * xc], tag, "fwd")  # Σ(x - m0), Σ(x - m0)^2: [...]
            shift = s1 / n
            mean = m0 + shift
            var = ((s2 - s1 * shift) / n).clamp_min(0)
            xc = xc - shift[..., None]
        else:
            mean = torch.zeros((), dtype=acc, device=x.device)
            var = _row_sum(grid, xa * xa, tag, "fwd") / n
            xc = xa
        rstd = torch.rsqrt(var + eps)  # [...]
        xhat = xc * rstd[..., None]
        ctx.save_for_backward(x, w, mean, rstd)
        ctx.args = (grid, n, centered, tag, None if b is None else b.dtype)
        y = xhat if w is None else xhat * w.to(acc)
        y = y if b is None else y + b.to(acc)
        out = x.dtype if w is None else torch.promote_types(x.dtype, w.dtype)
        return y.to(out if b is None else torch.promote_types(out, b.dtype))

    @staticmethod
    @once_differentiable  # a second derivative would need the statistics' own backward: refuse it loudly
    def backward(ctx, g):
        x, w, mean, rstd = ctx.saved_tensors
        grid, n, centered, tag, b_dtype = ctx.args
        acc = rstd.dtype
        xhat = (x.to(acc) - (mean[..., None] if centered else mean)) * rstd[..., None]
        gy = g.to(acc)
        gx = gy if w is None else gy * w.to(acc)  # dL/dxhat
        lead = tuple(range(x.dim() - 1))
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            if centered:
                s1, s2 = _row_sums(grid, [gx, gx * xhat], tag, "bwd") / n
                dx = (gx - s1[..., None] - xhat * s2[..., None]) * rstd[..., None]
            else:
                s2 = _row_sum(grid, gx * xhat, tag, "bwd") / n
                dx = (gx - xhat * s2[..., None]) * rstd[..., None]
            dx = dx.to(x.dtype)
        if w is not None and ctx.needs_input_grad[1]:
            dw = (gy * xhat).sum(lead).to(w.dtype)  # this rank's tokens; GradSync sums the rows
        if b_dtype is not None and ctx.needs_input_grad[2]:
            db = gy.sum(lead).to(b_dtype)
        return dx, dw, db, None, None, None, None, None


class ShardedNorm(nn.Module):
    """LayerNorm (or RMSNorm) over a last dim split over the mesh columns; see `_ShardedNormFn`."""

    def __init__(self, grid: Grid, n: int, eps, centered: bool, tag: str):
        super().__init__()
        self.grid, self.n, self.eps, self.centered, self.tag = grid, n, eps, centered, tag

    def forward(self, x, w=None, b=None):
        return _ShardedNormFn.apply(x, w, b, self.grid, self.n, self.eps, self.centered, self.tag)

    def extra_repr(self) -> str:
        return f"{'layer' if self.centered else 'rms'}, n={self.n}"


class GroupedHeadsAttention(nn.Module):
    """Attention of this column's torch.chunk block of the hq query heads against k and v whole over the
    columns (all hkv KV heads of this rank's batch block), when the columns do not divide the KV heads:
    each local query head reads KV head (global head) // (hq / hkv), picked here, so only the KV heads
    this column needs are kept for backward. k's and v's gradients are this column's share; the
    GradSync on them sums the columns."""

    def __init__(self, grid: Grid, heads: int, kv_heads: int, dropout_p: float, is_causal: bool, scale):
        super().__init__()
        self.grid, self.heads, self.kv_heads = grid, heads, kv_heads
        self.dropout_p, self.is_causal, self.scale = dropout_p, is_causal, scale

    def forward(self, q, k, v, mask=None):
        lo, hi = chunk_range(self.heads, self.grid.shape[1], self.grid.c)
        pick = torch.arange(lo, hi, device=k.device) // (self.heads // self.kv_heads)  # [hq/C]
        k, v = k.index_select(1, pick), v.index_select(1, pick)  # [b/R, hq/C, s_k, d]
        drop = self.dropout_p if self.training else 0.0
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=drop, is_causal=self.is_causal,
                                              scale=self.scale)

    def extra_repr(self) -> str:
        return f"heads={self.heads}, kv_heads={self.kv_heads}"


class VocabSplitEmbedding(nn.Module):
    """Lookup in a table whose vocab dim is split over `vocab_axis`: ids outside this rank's block
    give zero rows, so the result is a partial sum over that axis."""

    def __init__(self, grid: Grid, vocab_axis: int, padding_idx: int, tag: str, vocab: int | None = None,
                 where: str = ""):
        """`vocab`: the table's rows V, which place this rank's block when the axis does not divide V;
        `where`: the table as an out-of-range id's error names it."""
        super().__init__()
        self.grid, self.vocab_axis, self.padding_idx, self.tag = grid, vocab_axis, padding_idx, tag
        self.vocab, self.where = vocab, where or f"the vocab-split embedding {tag}"

    def forward(self, table, ids):
        rows = table.shape[0]  # V/q (this rank's torch.chunk block of V)
        vocab = self.vocab or rows * self.grid.size(self.vocab_axis)
        # an id outside the whole table is outside every block: it would sum to a zero row (passes.ops.bounds)
        torch.ops.autopar.check_ids(ids, vocab, self.where)
        start = chunk_range(vocab, self.grid.size(self.vocab_axis), self.grid.index(self.vocab_axis))[0]
        if rows == 0:  # an empty torch.chunk block (a table of 1 row over 2 rows): no id is inside it
            # zeros that keep the (empty) table in the graph, so its gradient is an empty tensor, not None
            return table.new_zeros(ids.shape + table.shape[1:]) + table.sum()
        local = ids - start
        inside = (local >= 0) & (local < rows)
        pad = self.padding_idx - start if 0 <= self.padding_idx - start < rows else -1
        out = F.embedding(local.masked_fill(~inside, 0), table, padding_idx=None if pad < 0 else pad)
        # select, never multiply: an inf or NaN in local row 0 times 0 would be NaN (one process never reads it)
        return out.masked_fill(~inside.unsqueeze(-1), 0)  # [..., h/q], partial over vocab blocks


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z, target, grid, ignore_index, tag, vocab_split=True, reduce_sum=False, rows_whole=False,
                vocab=None, where=""):
        zf = z.float()  # [n/q, V/q] (or [n/q, V] when the vocabulary is whole)
        rows = z.shape[1]
        # a torch.chunk block of a vocabulary the columns do not divide may be empty: its max is -inf
        m = zf.max(-1).values if rows else zf.new_full(zf.shape[:1], -torch.inf)
        if vocab_split:
            m = comm.all_reduce(grid, 1, m, tag, "fwd", op="max")  # [n/q]
        e = torch.exp(zf - m[:, None])
        start = chunk_range(vocab or rows * grid.shape[1], grid.shape[1], grid.c)[0]
        local = target - start if vocab_split else target
        inside = (local >= 0) & (local < rows)
        # select, never multiply by a mask: the clamped column of a target outside this block may be
        # -inf (a masked vocabulary entry) or NaN, and 0 * inf = NaN where one process is finite
        picked = torch.where(inside, zf.gather(1, local.clamp(0, rows - 1)[:, None]).squeeze(1), 0.0) if rows \
            else torch.zeros_like(m)
        sums = comm.all_reduce_stack(grid, 1 if vocab_split else None, [e.sum(-1), picked], tag, "fwd")  # [2, n/q]
        valid = target != ignore_index
        per_token = torch.where(valid, torch.log(sums[0]) + m - sums[1], 0.0)  # ignored rows may be NaN
        # each mesh row holds a block of the rows: sum them (unless every row holds all of them)
        # with the count of targets outside [0, V) (ignore_index aside), which every rank then checks
        size = vocab or rows * (grid.shape[1] if vocab_split else 1)
        bad = bounds.out_of_range(target, size, ignore_index).to(zf.dtype)
        axis = -1 if rows_whole else 0
        tot = comm.all_reduce_stack(grid, None if rows_whole else 0,
                                    [per_token.sum(), valid.sum().to(zf.dtype), bad], tag, "fwd")
        torch.ops.autopar.check_targets(target, tot, grid.key, axis, size, ignore_index, tag, where)
        # sums and tot saved whole, not the rows backward reads (the same storages): torch.compile refuses
        # a saved tensor that is a view of another tensor of the traced forward
        ctx.save_for_backward(e, sums, local, inside, valid, tot)
        ctx.dtype, ctx.reduce_sum = z.dtype, reduce_sum
        return tot[0] if reduce_sum else tot[0] / tot[1]  # fp32; the module casts

    @staticmethod
    @once_differentiable  # the backward reads saved statistics, not a graph: no second derivative
    def backward(ctx, g):
        e, sums, local, inside, valid, tot = ctx.saved_tensors
        grad = e / sums[0][:, None]  # softmax, minus one at the target where this rank holds it
        rows = grad.shape[1]
        if rows:
            grad.scatter_add_(1, local.clamp(0, rows - 1)[:, None], -inside[:, None].to(grad.dtype))
        scale = g if ctx.reduce_sum else g / tot[1]
        # an ignored row gets what torch's log_softmax backward gives it for a zero incoming gradient,
        # -softmax * 0: zero, but NaN where the row holds a NaN or +inf (its softmax is NaN) -- one
        # process's gradient there, kept for parity
        grad = torch.where(valid[:, None], grad * scale, grad * 0)
        return grad.to(ctx.dtype), None, None, None, None, None, None, None, None, None


class VocabParallelCrossEntropy(nn.Module):
    """Mean (or sum) cross-entropy over logits [N, V] split rows over mesh rows (all of them on every
    row if `rows_whole`) and (if `vocab_split`) vocab over mesh columns; statistics all-reduced, full
    logits never gathered; backward local."""

    def __init__(self, grid: Grid, ignore_index: int, tag: str, vocab_split: bool = True, reduce_sum: bool = False,
                 rows_whole: bool = False, vocab: int | None = None, where: str = ""):
        """`vocab`: V, which places this rank's block when the columns do not divide it; `where`: the
        loss as an out-of-range target's error names it."""
        super().__init__()
        self.grid, self.ignore_index, self.tag = grid, ignore_index, tag
        self.vocab_split, self.reduce_sum, self.rows_whole, self.vocab = vocab_split, reduce_sum, rows_whole, vocab
        self.where = where or f"the cross-entropy {tag}"

    def forward(self, logits, target):
        loss = _VocabParallelCE.apply(logits, target, self.grid, self.ignore_index, self.tag, self.vocab_split,
                                      self.reduce_sum, self.rows_whole, self.vocab, self.where)
        # under autocast torch's cross_entropy runs (and returns) fp32; otherwise it keeps the logits' dtype
        return loss if torch.is_autocast_enabled(logits.device.type) else loss.to(logits.dtype)
