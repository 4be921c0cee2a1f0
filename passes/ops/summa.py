"""SUMMA products on a q x q grid: AB, ABT and ATB, in two lowerings, with autograd.

Operands are the local 2-D blocks of global matrices. Rank (r, c) holds, for the product named:

    AB   C = A  B    A [M, K] block (r, c)   B [K, N] block (r, c)   ->  C [M, N] block (r, c)
    ABT  C = A  B^T  A [M, K] block (r, c)   B [N, K] block (r, c)   ->  C [M, N] block (r, c)
    ATB  C = A^T B   A [M, K] block (r, c)   B [M, N] block (r, c)   ->  C [K, N] block (r, c)

("block (r, c)" = row block r, column block c.) The broadcast lowering is the paper's: q steps, one
block broadcast per group per step, the next step's broadcast posted before the current matmul. The
all-gather lowering gathers the whole row/column panel first and runs one matmul; it moves the same
bytes with fewer, larger calls and q times the temporary memory.
"""

from __future__ import annotations

import torch

from passes.mesh import Grid
from passes.ops import comm

LOWERINGS = ("broadcast", "allgather")
AXIS_SAME_ROW, AXIS_SAME_COL = 1, 0  # mesh axis whose group shares the row / the column index


def _bcast_steps(grid: Grid, blocks, tag, phase):
    """Yield, for i in 0..q-1, the broadcast of each (tensor, axis) in `blocks` from member i.

    Step i+1's broadcasts are posted before step i is yielded, so they overlap its matmul.
    """

    def post(i):
        bufs, works = [], []
        for t, axis in blocks:
            buf = t if grid.index(axis) == i else torch.empty_like(t)
            bufs.append(buf)
            works.append(comm.broadcast(grid, axis, buf, i, tag, phase, async_op=True))
        return bufs, works

    pending = post(0)
    for i in range(grid.q):
        bufs, works = pending
        for w, (_, axis) in zip(works, blocks):
            comm.wait(w, grid, "broadcast", axis, tag)
        if i + 1 < grid.q:
            pending = post(i + 1)
        yield i, bufs


def _reduce_steps(grid: Grid, axis: int, partials, tag, phase):
    """Reduce partial i onto member i of `axis`'s group; return this member's sum."""
    works, mine = [], None
    for i, p in partials:
        works.append(comm.reduce(grid, axis, p, i, tag, phase, async_op=True))
        if grid.index(axis) == i:
            mine = p
    for w in works:
        comm.wait(w, grid, "reduce", axis, tag)
    return mine


def ab(grid: Grid, a, b, tag: str, phase: str = "fwd", lowering: str = "broadcast"):
    a, b = a.contiguous(), b.contiguous()  # a [m, k]  b [k, n]
    if lowering == "allgather":
        a_panel = comm.all_gather(grid, AXIS_SAME_ROW, a, 1, tag, phase)  # [m, q*k]
        b_panel = comm.all_gather(grid, AXIS_SAME_COL, b, 0, tag, phase)  # [q*k, n]
        return a_panel @ b_panel
    acc = torch.float32 if a.dtype in (torch.float16, torch.bfloat16) else a.dtype  # sum q steps in fp32
    out = a.new_zeros(a.shape[0], b.shape[1], dtype=acc)  # [m, n]
    for _, (a_i, b_i) in _bcast_steps(grid, [(a, AXIS_SAME_ROW), (b, AXIS_SAME_COL)], tag, phase):
        if acc == a.dtype:
            out.addmm_(a_i, b_i)
        else:
            out += a_i @ b_i
    return out.to(a.dtype)


def abt(grid: Grid, a, b, tag: str, phase: str = "fwd", lowering: str = "broadcast"):
    a, b = a.contiguous(), b.contiguous()  # a [m, k]  b [n, k]
    if lowering == "allgather":
        b_panel = comm.all_gather(grid, AXIS_SAME_COL, b, 0, tag, phase)  # [q*n, k]
        return comm.reduce_scatter(grid, AXIS_SAME_ROW, a @ b_panel.t(), 1, tag, phase)  # [m, n]
    steps = _bcast_steps(grid, [(b, AXIS_SAME_COL)], tag, phase)
    partials = [(i, a @ b_i.t()) for i, (b_i,) in steps]  # [m, n] each
    return _reduce_steps(grid, AXIS_SAME_ROW, partials, tag, phase)


def atb(grid: Grid, a, b, tag: str, phase: str = "fwd", lowering: str = "broadcast"):
    a, b = a.contiguous(), b.contiguous()  # a [m, k]  b [m, n]
    if lowering == "allgather":
        a_panel = comm.all_gather(grid, AXIS_SAME_ROW, a, 1, tag, phase)  # [m, q*k]
        return comm.reduce_scatter(grid, AXIS_SAME_COL, a_panel.t() @ b, 0, tag, phase)  # [k, n]
    steps = _bcast_steps(grid, [(a, AXIS_SAME_ROW)], tag, phase)
    partials = [(i, a_i.t() @ b) for i, (a_i,) in steps]  # [k, n] each
    return _reduce_steps(grid, AXIS_SAME_COL, partials, tag, phase)


class SummaAB(torch.autograd.Function):
    """C = A B; backward dA = ABT(dC, B), dB = ATB(A, dC)."""

    @staticmethod
    def forward(ctx, a, b, grid, tag, lowering):
        ctx.save_for_backward(a, b)
        ctx.args = (grid, tag, lowering)
        return ab(grid, a, b, tag, "fwd", lowering)

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        grid, tag, lowering = ctx.args
        da = abt(grid, g, b, tag, "bwd", lowering) if ctx.needs_input_grad[0] else None
        db = atb(grid, a, g, tag, "bwd", lowering) if ctx.needs_input_grad[1] else None
        return da, db, None, None, None


class SummaABT(torch.autograd.Function):
    """C = A B^T; backward dA = AB(dC, B), dB = ATB(dC, A)."""

    @staticmethod
    def forward(ctx, a, b, grid, tag, lowering):
        ctx.save_for_backward(a, b)
        ctx.args = (grid, tag, lowering)
        return abt(grid, a, b, tag, "fwd", lowering)

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        grid, tag, lowering = ctx.args
        da = ab(grid, g, b, tag, "bwd", lowering) if ctx.needs_input_grad[0] else None
        db = atb(grid, g, a, tag, "bwd", lowering) if ctx.needs_input_grad[1] else None
        return da, db, None, None, None


def summa_matmul(grid: Grid, x, w, *, transposed: bool, tag: str, lowering: str):
    """x [..., K] block (r, c) times a weight block; `transposed` says the block is of B^T [N, K].

    Leading dims of x are flattened into the row dim M; the result has x's leading dims.
    """
    if lowering not in LOWERINGS:
        raise ValueError(f"lowering={lowering!r} is not one of {LOWERINGS}")
    dev = x.device.type
    if torch.is_autocast_enabled(dev):  # what aten.linear does under autocast: both operands cast
        dtype = torch.get_autocast_dtype(dev)
        x, w = x.to(dtype), w.to(dtype)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])  # [m, k]
    fn = SummaABT if transposed else SummaAB
    out = fn.apply(x2, w, grid, tag, lowering)  # [m, n]
    return out.view(*lead, out.shape[-1])
