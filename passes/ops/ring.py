"""SUMMA products in the rotating (ring) lowering: the broadcast lowering's pieces, sent point to point in
Cannon's rotated order (the schedule: `passes.cost.rotation`).

Operands and results are the blocks of `passes.ops.summa` (AB, ABT, ATB on an R x C grid). The rank at
(r, c) runs the pieces of the shared dim starting at piece (r + c) mod S. At each step it receives the
operand piece it needs from the member that holds it and sends its own piece to the members that need
it; a product whose result is summed over a group (ABT over the columns, ATB over the rows) sends each
step's partial sum to the piece's owner, which adds it to its block. The next step's pieces are posted
before the current matmul, so their transfer overlaps it; a step's partial sums are sent and waited
for before the next step's are formed, so a rank holds one partial and one received buffer at a time.

Cannon's algorithm reaches this alignment with an initial skew and then shifts every block to the
neighbour at each step. Here each piece goes straight from its owner to the rank that needs it, so
nothing is skewed and a rank receives exactly the pieces (and partial sums) the broadcast lowering
gives it: the same bytes. A rank holds its own blocks, the piece it computes with and the next one in
flight, and (ABT, ATB) one partial sum going out and one coming in; the broadcast lowering holds all
of a product's partial sums until it reduces them, so for ABT and ATB the ring holds less from q = 4
on (docs/benchmarks.md, "SUMMA lowerings"). On a q x q grid with even blocks each step is a
permutation of every row and column: one send and one receive per rank and axis, q - 1 steps with
traffic.
"""

from __future__ import annotations

import torch

from passes.cost.rotation import DEST, OWNER, exchange, piece_at, product_segments
from passes.layout import chunk_range
from passes.mesh import Grid
from passes.ops import comm

__all__ = ["ab", "abt", "atb"]


def _acc_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float32 if t.dtype in (torch.float16, torch.bfloat16) else t.dtype  # sum the steps in fp32


class _Schedule:
    """One product's pieces (`segs`) and this rank's view of who moves what at each step."""

    def __init__(self, grid: Grid, kind: str, K: int, N: int):
        self.grid, self.at = grid, (grid.r, grid.c)
        self.segs, axes = product_segments(kind, grid.shape, K, N)
        self.operand_axis, self.other_axis = axes[0][0], axes[1][0]

    def piece(self, t: int, member: int | None = None, axis: int = 0) -> tuple:
        """The piece this rank (or `member` of its group over `axis`) works on at step t."""
        r, c = self.at
        if member is not None:
            r, c = (member, c) if axis == 0 else (r, member)
        return self.segs[piece_at(len(self.segs), t, (r, c))]

    def moves(self, role: int, axis: int, t: int):
        return exchange(self.segs, role, self.grid.shape, self.at, axis, t)

    def operand(self, t: int, role: int, axis: int, cut, buffer, tag: str, phase: str) -> tuple:
        """Post step t's operand exchange over `axis`: (Posted or None, the piece to compute with).
        `cut(seg)`: this rank's part of piece `seg` (it owns it); `buffer(seg)`: an empty one to receive."""
        x = self.moves(role, axis, t)
        sends = [(m, cut(self.piece(t, m, axis)).contiguous()) for m in x.dsts]
        mine = self.piece(t)
        value = cut(mine) if x.src is None else buffer(mine)
        return comm.exchange(self.grid, axis, sends, [] if x.src is None else [(x.src, value)], tag, phase), value

    def operands(self, role: int, axis: int, cut, buffer, tag: str, phase: str):
        """Yield (t, piece) for every step, step t + 1's exchange posted before step t is yielded (with
        `grid.prefetch` False: after step t's matmul)."""
        def post(t):
            posted, value = self.operand(t, role, axis, cut, buffer, tag, phase)

            def wait():
                if posted is not None:
                    posted.wait()
                return t, value
            return wait

        return comm.in_turn(len(self.segs), post, self.grid.prefetch)


def _sum_partials(sched: _Schedule, out: torch.Tensor, dim: int, start: int, factors, cut, buffer,
                  tag: str, phase: str) -> torch.Tensor:
    """Run the steps of a product whose result is summed over `sched.other_axis`: step t's partial sum
    of its piece (along the shared dim `dim` of `out`) is x @ y for (x, y) = `factors(piece)`. A piece
    this rank owns is accumulated into `out` (its block starts at `start`) in place; any other goes to
    its owner, and the partials of the members that need this rank's piece are received and added.
    Each step's partial sums are waited for before the next is formed: one partial and one received
    buffer at a time (the operands' next pieces are still in flight during the matmul)."""
    axis = sched.other_axis

    def block(seg: tuple) -> torch.Tensor:
        return out.narrow(dim, seg[0] - start, seg[1] - seg[0])

    for t, piece in sched.operands(OWNER, sched.operand_axis, cut, buffer, tag, phase):
        x, y = factors(piece)
        moves = sched.moves(DEST, axis, t)
        sends = []
        if moves.src is None:
            mine = block(sched.piece(t))
            if mine.dtype == x.dtype:
                mine.addmm_(x, y)
            else:
                mine += x @ y
        else:
            sends = [(moves.src, x @ y)]
        segs = [sched.piece(t, m, axis) for m in moves.dsts]
        bufs = [x.new_empty(_shape(out, dim, seg)) for seg in segs]
        posted = comm.exchange(sched.grid, axis, sends, list(zip(moves.dsts, bufs)), tag, phase)
        if posted is not None:
            posted.wait()
        for seg, buf in zip(segs, bufs):
            block(seg).add_(buf)
        del sends, bufs, posted  # the partial sent and the buffers received: free before the next step's
    return out


def _shape(t: torch.Tensor, dim: int, seg: tuple) -> list:
    shape = list(t.shape)
    shape[dim] = seg[1] - seg[0]
    return shape


def ab(grid: Grid, a: torch.Tensor, b: torch.Tensor, tag: str, phase: str, K: int) -> torch.Tensor:
    """a [m, K/C] block (r, c), b [K/R, n] block (r, c) -> a b [m, n] block (r, c)."""
    R, C = grid.shape
    ka, kb = -(-K // C), -(-K // R)
    sched = _Schedule(grid, "ab", K, 0)
    m, n = a.shape[0], b.shape[1]
    cut_a = lambda seg: a.narrow(1, seg[0] - seg[OWNER] * ka, seg[1] - seg[0])  # noqa: E731
    cut_b = lambda seg: b.narrow(0, seg[0] - seg[DEST] * kb, seg[1] - seg[0])  # noqa: E731
    a_steps = sched.operands(OWNER, 1, cut_a, lambda seg: a.new_empty(m, seg[1] - seg[0]), tag, phase)
    b_steps = sched.operands(DEST, 0, cut_b, lambda seg: b.new_empty(seg[1] - seg[0], n), tag, phase)
    acc = _acc_dtype(a)
    out = a.new_zeros(m, n, dtype=acc)
    for (_, a_t), (_, b_t) in zip(a_steps, b_steps):
        if acc == a.dtype:
            out.addmm_(a_t, b_t)
        else:
            out += a_t @ b_t
    return out.to(a.dtype)


def abt(grid: Grid, a: torch.Tensor, b: torch.Tensor, tag: str, phase: str, N: int) -> torch.Tensor:
    """a [m, K/C] block (r, c), b [N/R, K/C] block (r, c) -> a b^T [m, N/C] block (r, c)."""
    R, C = grid.shape
    nb, nc = -(-N // R), -(-N // C)
    sched = _Schedule(grid, "abt", 0, N)
    lo, hi = chunk_range(N, C, grid.c)
    out = a.new_zeros(a.shape[0], hi - lo, dtype=_acc_dtype(a))
    cut_b = lambda seg: b.narrow(0, seg[0] - seg[OWNER] * nb, seg[1] - seg[0])  # noqa: E731
    buf_b = lambda seg: b.new_empty(seg[1] - seg[0], b.shape[1])  # noqa: E731
    _sum_partials(sched, out, 1, grid.c * nc, lambda b_t: (a, b_t.t()), cut_b, buf_b, tag, phase)
    return out.to(a.dtype)


def atb(grid: Grid, a: torch.Tensor, b: torch.Tensor, tag: str, phase: str, K: int) -> torch.Tensor:
    """a [m, K/C] block (r, c), b [m, n] block (r, c) -> a^T b [K/R, n] block (r, c), summed over the rows."""
    R, C = grid.shape
    ka, kb = -(-K // C), -(-K // R)
    sched = _Schedule(grid, "atb", K, 0)
    lo, hi = chunk_range(K, R, grid.r)
    out = b.new_zeros(hi - lo, b.shape[1], dtype=_acc_dtype(b))
    cut_a = lambda seg: a.narrow(1, seg[0] - seg[OWNER] * ka, seg[1] - seg[0])  # noqa: E731
    buf_a = lambda seg: a.new_empty(a.shape[0], seg[1] - seg[0])  # noqa: E731
    _sum_partials(sched, out, 0, grid.r * kb, lambda a_t: (a_t.t(), b), cut_a, buf_a, tag, phase)
    return out.to(b.dtype)
