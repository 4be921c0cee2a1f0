"""SUMMA products on an R x C grid: AB, ABT and ATB, in three lowerings, with autograd.

Operands are the local 2-D blocks of global matrices (row blocks over the R mesh rows, column blocks
over the C mesh columns). Rank (r, c) holds, for the product named:

    AB   C = A  B    A [M, K] block (r, c)   B [K, N] block (r, c)   ->  C [M, N] block (r, c)
    ABT  C = A  B^T  A [M, K] block (r, c)   B [N, K] block (r, c)   ->  C [M, N] block (r, c)
    ATB  C = A^T B   A [M, K] block (r, c)   B [M, N] block (r, c)   ->  C [K, N] block (r, c)

("block (r, c)" = row block r, column block c.) The broadcast lowering is the paper's: one step per
piece of the shared dim, one broadcast per group per step, the next step's broadcast posted before the
current matmul. On a square grid the pieces are the q blocks; on an R x C grid the contracted dim is
split C ways in one operand and R ways in the other, so it is cut at both sets of block boundaries
(R + C - gcd(R, C) pieces, see `segments`) and each piece is broadcast by the member that holds it.
The all-gather lowering gathers the whole row/column panel first and runs one matmul; it moves the
same bytes with fewer, larger calls and more temporary memory. The rotating (ring) lowering
(`passes.ops.ring`) moves the broadcast lowering's pieces point to point, in Cannon's rotated order:
the same bytes, no collective. Every product takes its `lowering` ('broadcast', 'allgather' or
'ring') by name: the option's 'auto' is resolved per product before it runs (`passes.search.lowering`).
"""

from __future__ import annotations

import math

import torch

from passes.cost.rotation import segments
from passes.layout import chunk_range
from passes.mesh import Grid
from passes.options import LOWERINGS
from passes.ops import comm, ring
from passes.ops.comm import Posted
from passes.errors import UsageError

AXIS_SAME_ROW, AXIS_SAME_COL = 1, 0  # mesh axis whose group shares the row / the column index


def _piece(grid: Grid, t: torch.Tensor, axis: int, owner: int, dim: int, lo: int, hi: int) -> torch.Tensor:
    """The owner's [lo, hi) of `t` along `dim` (offsets into the owner's block); a buffer of that shape
    on the other members, whose own blocks may be shorter (torch.chunk blocks)."""
    if grid.size(axis) == 1 or grid.index(axis) == owner:
        return t.narrow(dim, lo, hi - lo)
    shape = list(t.shape)
    shape[dim] = hi - lo
    return t.new_empty(shape)


def _bcast_steps(grid: Grid, steps, tag, phase):
    """For each step, a list of (tensor, axis, src member): yield the broadcast tensors, step by step.

    Step i+1's broadcasts are posted before step i is yielded, so they overlap its matmul (with
    `grid.prefetch` False: after it, each step's transfer waited for in line). On an axis of size 1
    nothing is sent.
    """

    def post(i):
        bufs, works = [], []
        for t, axis, src in steps[i]:
            if grid.size(axis) == 1:
                bufs.append(t)
                works.append(None)
                continue
            buf = t.contiguous()  # the owner's piece, or a fresh buffer on the others (`_piece`)
            bufs.append(buf)
            works.append(comm.broadcast(grid, axis, buf, src, tag, phase, async_op=True))

        def wait():
            for w, (_, axis, _) in zip(works, steps[i]):
                if w is not None:
                    comm.wait(w, grid, "broadcast", axis, tag)
            return bufs
        return wait

    return comm.in_turn(len(steps), post, grid.prefetch)


def _post_reduce_steps(grid: Grid, axis: int, partials, dim: int, tag, phase, empty: torch.Tensor) -> Posted:
    """Launch the reduce of each partial onto its destination member of `axis`'s group; the `Posted`
    whose wait gives the concatenation (along `dim`) of the pieces this member receives (`empty` when
    its torch.chunk block is empty)."""
    if grid.size(axis) == 1:
        out = torch.cat([p for _, p in partials], dim) if len(partials) > 1 else partials[0][1]
        return Posted(grid, tag, [], lambda: out)
    works, mine = [], []
    for dst, p in partials:
        works.append((comm.reduce(grid, axis, p, dst, tag, phase, async_op=True), "reduce", axis))
        if grid.index(axis) == dst:
            mine.append(p)
    kept = tuple(p for _, p in partials)
    if not mine:
        return Posted(grid, tag, works, lambda: empty, kept)
    return Posted(grid, tag, works, lambda: mine[0] if len(mine) == 1 else torch.cat(mine, dim), kept)


def _reduce_steps(grid: Grid, axis: int, partials, dim: int, tag, phase, empty: torch.Tensor):
    """`_post_reduce_steps`, waited for."""
    return _post_reduce_steps(grid, axis, partials, dim, tag, phase, empty).wait()


def ab(grid: Grid, a, b, tag: str, phase: str = "fwd", *, lowering: str, full: int | None = None):
    """`full`: the contracted dim's global size K, given when the grid does not divide it."""
    a, b = a.contiguous(), b.contiguous()  # a [m, K/C]  b [K/R, n]
    R, C = grid.shape
    K = a.shape[1] * C if full is None else full
    if lowering == "allgather":
        if grid.prefetch:  # both panels' gathers in flight at once (two groups), then waited for
            a_post = comm.post_all_gather(grid, AXIS_SAME_ROW, a, 1, tag, phase, K)
            b_post = comm.post_all_gather(grid, AXIS_SAME_COL, b, 0, tag, phase, K)
            return a_post.wait() @ b_post.wait()
        a_panel = comm.all_gather(grid, AXIS_SAME_ROW, a, 1, tag, phase, K)  # [m, K]
        b_panel = comm.all_gather(grid, AXIS_SAME_COL, b, 0, tag, phase, K)  # [K, n]
        return a_panel @ b_panel
    if lowering == "ring":
        return ring.ab(grid, a, b, tag, phase, K)
    ka, kb = -(-K // C), -(-K // R)
    steps = [[(_piece(grid, a, AXIS_SAME_ROW, i, 1, s - i * ka, e - i * ka), AXIS_SAME_ROW, i),
              (_piece(grid, b, AXIS_SAME_COL, j, 0, s - j * kb, e - j * kb), AXIS_SAME_COL, j)]
             for s, e, i, j in segments(K, C, R)]
    acc = torch.float32 if a.dtype in (torch.float16, torch.bfloat16) else a.dtype  # sum the steps in fp32
    out = a.new_zeros(a.shape[0], b.shape[1], dtype=acc)  # [m, n]
    for a_i, b_i in _bcast_steps(grid, steps, tag, phase):
        if acc == a.dtype:
            out.addmm_(a_i, b_i)
        else:
            out += a_i @ b_i
    return out.to(a.dtype)


def abt(grid: Grid, a, b, tag: str, phase: str = "fwd", *, lowering: str, full: int | None = None):
    """`full`: the output's dim N (b's rows) when the grid does not divide it."""
    a, b = a.contiguous(), b.contiguous()  # a [m, K/C]  b [N/R, K/C]  ->  [m, N/C]
    R, C = grid.shape
    N = b.shape[0] * R if full is None else full
    if lowering == "allgather":
        b_panel = comm.all_gather(grid, AXIS_SAME_COL, b, 0, tag, phase, N)  # [N, K/C]
        return comm.reduce_scatter(grid, AXIS_SAME_ROW, a @ b_panel.t(), 1, tag, phase)  # [m, N/C]
    if lowering == "ring":
        return ring.abt(grid, a, b, tag, phase, N)
    nb = -(-N // R)
    segs = segments(N, R, C)
    steps = [[(_piece(grid, b, AXIS_SAME_COL, j, 0, s - j * nb, e - j * nb), AXIS_SAME_COL, j)] for s, e, j, _ in segs]
    partials = [(i, a @ b_s.t()) for (_, _, _, i), (b_s,) in zip(segs, _bcast_steps(grid, steps, tag, phase))]
    return _reduce_steps(grid, AXIS_SAME_ROW, partials, 1, tag, phase, a.new_zeros(a.shape[0], 0))


def atb(grid: Grid, a, b, tag: str, phase: str = "fwd", *, lowering: str, rows_whole: bool = False,
        full: int | None = None):
    """`rows_whole`: every mesh row holds all m rows of a and b (a batch the rows do not divide), so
    each row forms its own [K/R, n] block in full and nothing is summed over the rows. `full`: the
    dim K (a's columns) when the grid does not divide it."""
    return post_atb(grid, a, b, tag, phase, lowering, rows_whole, full).wait()


def post_atb(grid: Grid, a, b, tag: str, phase: str, lowering: str, rows_whole: bool = False,
             full: int | None = None) -> Posted:
    """`atb` up to its reduction over the mesh rows, which is launched and not waited for: its partial
    products formed (their broadcasts or gather waited for), the reduce or reduce-scatter in flight."""
    a, b = a.contiguous(), b.contiguous()  # a [m, K/C]  b [m, n]  ->  [K/R, n]
    R, C = grid.shape
    K = a.shape[1] * C if full is None else full
    if lowering == "allgather":
        a_panel = comm.all_gather(grid, AXIS_SAME_ROW, a, 1, tag, phase, K)  # [m, K]
        if rows_whole:
            lo, hi = chunk_range(K, R, grid.index(AXIS_SAME_COL))
            out = a_panel[:, lo:hi].t() @ b  # [K/R, n]
            return Posted(grid, tag, [], lambda: out)
        return comm.post_reduce_scatter(grid, AXIS_SAME_COL, a_panel.t() @ b, 0, tag, phase)  # [K/R, n]
    if lowering == "ring" and not rows_whole:  # rows_whole sums nothing: its pieces are broadcast as below
        out = ring.atb(grid, a, b, tag, phase, K)
        return Posted(grid, tag, [], lambda: out)
    ka = -(-K // C)
    segs = segments(K, C, R)
    if rows_whole:  # only the pieces of this row's block; the whole row group skips the same steps
        segs = [seg for seg in segs if seg[3] == grid.index(AXIS_SAME_COL)]
    steps = [[(_piece(grid, a, AXIS_SAME_ROW, i, 1, s - i * ka, e - i * ka), AXIS_SAME_ROW, i)] for s, e, i, _ in segs]
    partials = [(j, a_s.t() @ b) for (_, _, _, j), (a_s,) in zip(segs, _bcast_steps(grid, steps, tag, phase))]
    empty = a.new_zeros(0, b.shape[1])
    if rows_whole:
        out = torch.cat([p for _, p in partials], 0) if len(partials) > 1 else (partials[0][1] if partials else empty)
        return Posted(grid, tag, [], lambda: out)
    return _post_reduce_steps(grid, AXIS_SAME_COL, partials, 0, tag, phase, empty)


def product(grid: Grid, kind: str, a, b, tag: str, phase: str, lowering: str, rows_whole: bool = False,
            full: int | None = None):
    """`ab`, `abt` or `atb` (`kind`) through its torch.library op (`passes.ops.library`): one opaque
    call to torch.compile, the same eager code inside. `full`: the size of the dim the grid does not
    divide (see `ab`, `abt`, `atb`)."""
    return torch.ops.autopar.summa(a, b, grid.key, kind, tag, phase, lowering, rows_whole, full)


def backward_pair(grid: Grid, dx, post_dw, wait_dw) -> tuple:
    """(dX, dW) of one product's backward, from callables (None: that operand needs no gradient): `dx()`
    the input's product, `post_dw()` dW up to its reduction over the rows, launched (`passes.ops.overlap`),
    `wait_dw()` dW once reduced. dW is launched first and waited for last, so its reduction overlaps
    dX's product; with `grid.overlap_grad_reduce` False, dX runs first and dW after it, in line."""
    if post_dw is None:
        return (dx() if dx else None), None
    if dx is None or not grid.overlap_grad_reduce:
        first = dx() if dx else None
        post_dw()
        return first, wait_dw()
    post_dw()
    return dx(), wait_dw()


def _dw_ops(grid: Grid, needed: bool, a, b, tag: str, lowering: str, rows_whole: bool, full) -> tuple:
    """(post, wait) of ATB(a, b) in phase "bwd" (`passes.ops.overlap`'s two ops), or (None, None)."""
    if not needed:
        return None, None
    args = (a, b, grid.key, tag, lowering, rows_whole, full)
    return (lambda: torch.ops.autopar.atb_post(*args)), (lambda: torch.ops.autopar.atb_wait(*args))


class SummaAB(torch.autograd.Function):
    """C = A B; backward dA = ABT(dC, B), dB = ATB(A, dC) (`backward_pair`). `full`: K, when the grid
    does not divide it (A's columns are torch.chunk blocks over the mesh columns, B's rows over the rows)."""

    @staticmethod
    def forward(ctx, a, b, grid, tag, lowering, rows_whole=False, full=None):
        ctx.save_for_backward(a, b)
        ctx.args = (grid, tag, lowering, rows_whole, full)
        return product(grid, "ab", a, b, tag, "fwd", lowering, full=full)

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        grid, tag, lowering, rows_whole, full = ctx.args
        dx = (lambda: product(grid, "abt", g, b, tag, "bwd", lowering, full=full)) if ctx.needs_input_grad[0] else None
        da, db = backward_pair(grid, dx, *_dw_ops(grid, ctx.needs_input_grad[1], a, g, tag, lowering, rows_whole, full))
        return da, db, None, None, None, None, None


class SummaABT(torch.autograd.Function):
    """C = A B^T; backward dA = AB(dC, B), dB = ATB(dC, A) (`backward_pair`). `full`: N, when the grid
    does not divide it (a vocabulary: B^T's rows are torch.chunk blocks over the mesh rows, C's columns
    over the columns)."""

    @staticmethod
    def forward(ctx, a, b, grid, tag, lowering, rows_whole=False, full=None):
        ctx.save_for_backward(a, b)
        ctx.args = (grid, tag, lowering, rows_whole, full)
        return product(grid, "abt", a, b, tag, "fwd", lowering, full=full)

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        grid, tag, lowering, rows_whole, full = ctx.args
        dx = (lambda: product(grid, "ab", g, b, tag, "bwd", lowering, full=full)) if ctx.needs_input_grad[0] else None
        da, db = backward_pair(grid, dx, *_dw_ops(grid, ctx.needs_input_grad[1], g, a, tag, lowering, rows_whole, full))
        return da, db, None, None, None, None, None


def summa_matmul(grid: Grid, x, w, *, transposed: bool, tag: str, lowering: str, rows_whole: bool = False,
                 full: int | None = None):
    """x [..., K] block (r, c) times a weight block; `transposed` says the block is of B^T [N, K];
    `full`: the size of the dim the steps cut (K for AB, N for ABT), given when the grid does not
    divide it (torch.chunk blocks).

    Leading dims of x are flattened into the row dim M; the result has x's leading dims. With
    `rows_whole` every mesh row holds all of M (a batch the rows do not divide): the products run the
    same, and the weight's gradient is not summed over the rows (see `atb`).
    """
    if lowering not in LOWERINGS:
        raise UsageError(f"lowering={lowering!r} is not one of {LOWERINGS}")
    dev = x.device.type
    if torch.is_autocast_enabled(dev):  # what aten.linear does under autocast: both operands cast
        dtype = torch.get_autocast_dtype(dev)
        x, w = x.to(dtype), w.to(dtype)
    lead = x.shape[:-1]
    x2 = x.reshape(math.prod(lead), x.shape[-1])  # [m, k]; k may be 0 (an empty torch.chunk block)
    if transposed:
        out = SummaABT.apply(x2, w, grid, tag, lowering, rows_whole, full)  # [m, n]
    else:
        out = SummaAB.apply(x2, w, grid, tag, lowering, rows_whole, full)  # [m, n]
    return out.view(*lead, out.shape[-1])
