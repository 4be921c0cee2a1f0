"""Ring attention: each rank's queries against every cp rank's keys and values, the K/V blocks passed around
the cp ring (Liu et al., arXiv:2310.01889), with the softmax merged block by block (online softmax, as flash
attention's tiles are: running log-sum-exp per query row).

Rank i holds the zig-zag chunks i and 2cp−1−i (`passes.ops.context`). At ring step s it holds the K/V block of
rank j = (i − s) mod cp; under a causal mask only what some query sees is computed:

- j = i: the local block, masked by global position (each chunk against itself causal, the late chunk
  against the early one whole);
- j < i: every query against j's early chunk only (its late chunk lies after all of i's tokens);
- j > i: i's late chunk only, against both of j's chunks whole.

Every step after the first is one chunk of queries against two of keys, or two against one: the same work on
every rank (the load balancing the zig-zag split exists for). Without a causal mask every block is whole.

The next block's transfer (`comm.exchange`: send the held block to rank i+1, receive rank i−1's) is posted
before the current block is computed, so it travels behind the product. Backward passes K and V around the
ring again with their gradients' running sums beside them: each rank adds its queries' part and sends the sum
on, and after cp steps each sum reaches the rank that holds its block. The block products recompute the scores
from q, k and the saved log-sum-exp (flash attention's backward); nothing of size S² is saved, and the scores of
one block are computed in row tiles of at most `TILE` elements.

Bytes each rank receives per attention (`passes.cost.context.ring_bytes`): forward (cp−1) K/V blocks; backward
(cp−1) K/V blocks and cp gradient blocks, in K's dtype. Query heads read KV head h // g (grouped-query
attention) without repeating K and V: the KV heads travel as they are.

The block products are plain matmuls and `logsumexp` on any device: correct everywhere, not a fused kernel.
"""

from __future__ import annotations

import torch

from passes.mesh import CP_AXIS, Grid
from passes.ops import comm

__all__ = ["RingAttention", "TILE", "pieces"]

TILE = 1 << 24  # at most this many score elements of one block computed at once (64 MiB in float32)


def pieces(i: int, j: int, n: int, causal: bool) -> list:
    """(query rows, key columns, masked) of rank i's n queries that see rank j's n keys (see the module text)."""
    every, h = slice(0, n), n // 2
    if not causal:
        return [(every, every, False)]
    if j == i:
        return [(every, every, True)]
    return [(every, slice(0, h), False)] if j < i else [(slice(h, n), every, False)]


def _ring(grid: Grid, block: torch.Tensor, tag: str, phase: str):
    """(j, rank j's block) for ring steps s = 0 .. cp−1, j = (i − s) mod cp; the next step's block is received
    while the current one is in use."""
    cp, i = grid.cp, grid.cp_index
    for s in range(cp):
        posted = None
        if s + 1 < cp:
            got = torch.empty_like(block)
            posted = comm.exchange(grid, CP_AXIS, [((i + 1) % cp, block)], [((i - 1) % cp, got)], tag, phase)
        yield (i - s) % cp, block
        if posted is not None:
            posted.wait()
            block = got


def _tiles(rows: slice, per_row: int):
    """`rows` cut into tiles whose scores hold at most TILE elements (`per_row` per query row)."""
    step = max(1, TILE // max(per_row, 1))
    for a in range(rows.start, rows.stop, step):
        yield slice(a, min(a + step, rows.stop))


def _pack(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """K and V in one flat buffer (one transfer per ring step; v's head dim may differ from k's), in k's dtype."""
    return torch.cat([k.reshape(-1), v.reshape(-1).to(k.dtype)])


def _unpack(flat: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple:
    """`_pack` undone: views of k's and v's shapes."""
    return flat[:k.numel()].view(k.shape), flat[k.numel():].view(v.shape)


def _acc(t: torch.Tensor) -> torch.dtype:
    """The dtype the block products, softmax sums and gradient sums run in: float32, or t's where wider (bf16
    scores would carry 2⁻⁸ relative errors into exp; flash attention keeps them in float32 too)."""
    return torch.promote_types(t.dtype, torch.float32)


def _scores(q, k, scale: float, mask) -> torch.Tensor:
    """[b, hk, g, m, c] scores of q [b, hk, g, m, d] against k [b, hk, c, d]; masked: −inf."""
    s = torch.matmul(q, k.unsqueeze(2).transpose(-1, -2)) * scale
    return s if mask is None else torch.where(mask, s, torch.full_like(s, float("-inf")))


class RingAttention(torch.autograd.Function):
    """softmax(q kᵀ·scale (+ causal mask)) v over the cp ranks' tokens; q [b, h, n, d], k and v [b, hk, n, d]
    this rank's zig-zag tokens (hk dividing h); the output [b, h, n, d] (see the module text). K and V travel
    in k's dtype; the products run in `_acc`'s."""

    @staticmethod
    def forward(ctx, q, k, v, grid: Grid, mask, scale, tag: str):
        """`mask`: [n, n] bool, which of this rank's own keys each of its queries sees (causal), or None."""
        b, h, n, d = q.shape
        hk, acc, causal = k.shape[1], _acc(q), mask is not None
        scale = d ** -0.5 if scale is None else scale
        q5 = q.reshape(b, hk, h // hk, n, d).to(acc)
        out = torch.zeros((b, hk, h // hk, n, v.shape[-1]), dtype=acc, device=q.device)
        lse = torch.full(q5.shape[:-1], float("-inf"), dtype=acc, device=q.device)
        for j, kv in _ring(grid, _pack(k, v), f"{tag} kv", "fwd"):
            kj, vj = (t.to(acc) for t in _unpack(kv, k, v))
            for rows, cols, masked in pieces(grid.cp_index, j, n, causal):
                for t in _tiles(rows, b * h * (cols.stop - cols.start)):
                    s = _scores(q5[..., t, :], kj[..., cols, :], scale, mask[t, cols] if masked else None)
                    blse = s.logsumexp(-1)
                    o = torch.matmul(torch.exp(s - blse[..., None]), vj[..., cols, :].unsqueeze(2))
                    new = torch.logaddexp(lse[..., t], blse)
                    out[..., t, :] = (out[..., t, :] * torch.exp(lse[..., t] - new)[..., None]
                                      + o * torch.exp(blse - new)[..., None])
                    lse[..., t] = new
        y = out.to(q.dtype).reshape(b, h, n, v.shape[-1])
        ctx.save_for_backward(q, k, v, y, lse)
        ctx.args = (grid, mask, scale, tag)
        return y

    @staticmethod
    def backward(ctx, dy):
        q, k, v, y, lse = ctx.saved_tensors
        grid, mask, scale, tag = ctx.args
        b, h, n, d = q.shape
        hk, cp, i, acc, causal = k.shape[1], grid.cp, grid.cp_index, _acc(q), mask is not None
        q5 = q.reshape(b, hk, h // hk, n, d).to(acc)
        dy5 = dy.reshape(b, hk, h // hk, n, v.shape[-1]).to(acc)
        delta = (dy5 * y.reshape(dy5.shape).to(acc)).sum(-1)  # rowsum(dO ∘ O), flash attention's D
        dq = torch.zeros(q5.shape, dtype=acc, device=q.device)
        sums = None  # the gradient sums in flight: (posted, buffer)
        for j, kv in _ring(grid, _pack(k, v), f"{tag} kv", "bwd"):
            kj, vj = (t.to(acc) for t in _unpack(kv, k, v))
            flat = torch.zeros(k.numel() + v.numel(), dtype=acc, device=k.device)
            dk_j, dv_j = _unpack(flat, k, v)  # views: this rank's part of rank j's K and V gradients
            for rows, cols, masked in pieces(i, j, n, causal):
                kc, vc = kj[..., cols, :].unsqueeze(2), vj[..., cols, :].unsqueeze(2)
                for t in _tiles(rows, b * h * (cols.stop - cols.start)):
                    s = _scores(q5[..., t, :], kj[..., cols, :], scale, mask[t, cols] if masked else None)
                    p = torch.exp(s - lse[..., t, None])  # masked: exp(−inf) = 0
                    do = dy5[..., t, :]
                    dv_j[..., cols, :] += torch.matmul(p.transpose(-1, -2), do).sum(2)
                    ds = p * (torch.matmul(do, vc.transpose(-1, -2)) - delta[..., t, None])
                    dq[..., t, :] += torch.matmul(ds, kc) * scale
                    dk_j[..., cols, :] += torch.matmul(ds.transpose(-1, -2), q5[..., t, :]).sum(2) * scale
            if sums is not None:
                sums[0].wait()
                flat += sums[1].to(acc)
            got = torch.empty(flat.shape, dtype=k.dtype, device=k.device)
            sums = (comm.exchange(grid, CP_AXIS, [((i + 1) % cp, flat.to(k.dtype))], [((i - 1) % cp, got)],
                                  f"{tag} dkv", "bwd"), got)
        sums[0].wait()
        dk, dv = _unpack(sums[1], k, v)  # every rank's part of this rank's K and V gradients, summed around the ring
        return dq.to(q.dtype).reshape(b, h, n, d), dk, dv.to(v.dtype), None, None, None, None
