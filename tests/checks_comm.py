"""Rank-side checks of the collective layer: groups, SUMMA products and redistributions against
brute-force results computed from the full tensors (identical on every rank: same seed)."""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist
from torch.distributed.tensor import Partial, Replicate, Shard

from passes.layout import Layout
from passes.mesh import Grid
from passes.ops import kernels, summa
from tests.compare import RTOL, excess, scaled_atol

# A redistribution only moves values (and adds zeros, or averages copies): a few ulp at most.
MOVE_RTOL, MOVE_ATOL_FRAC = 1e-6, 1e-7


def block_of(full: torch.Tensor, lay: Layout, grid: Grid) -> torch.Tensor:
    """The block rank (r, c) holds of `full` under `lay` (Partial: rank 0 of the axis holds it all)."""
    t = full
    for axis, p in enumerate(lay.placements):
        if isinstance(p, Shard):
            t = t.chunk(grid.size(axis), dim=p.dim)[grid.index(axis)]
        elif isinstance(p, Partial) and p.reduce_op == "sum" and grid.index(axis) != 0:
            t = torch.zeros_like(t)
    return t.clone(memory_format=torch.contiguous_format)  # a fresh leaf, not a view of `full`


def _grid(q) -> Grid:
    return Grid(*q) if isinstance(q, (tuple, list)) else Grid(q, q)


def groups(rank, q):
    g = _grid(q)
    return {
        "r, c": (g.r, g.c),
        "same_row": dist.get_process_group_ranks(g.same_row_group),
        "same_col": dist.get_process_group_ranks(g.same_col_group),
    }


def summa_products(rank, q, lowering):
    """AB, ABT, ATB forward and the gradients of SummaAB / SummaABT against torch on full matrices,
    as {"excess": {name: excess}, "bytes": {product: bytes this rank received in its forward}}. The
    atol of each product is scaled to its full result, of each gradient to the full gradient."""
    g = _grid(q)
    torch.manual_seed(0)
    R, C_ = g.shape
    M, K, N = 6 * R * C_, 4 * R * C_, 5 * R * C_
    A, B, Bt, C = (torch.randn(M, K), torch.randn(K, N), torch.randn(N, K), torch.randn(M, N))
    split = Layout((Shard(0), Shard(1)))
    blk = lambda t: block_of(t, split, g)  # noqa: E731
    err, nbytes = {}, {}
    for name, fn, other, want in (("AB", summa.ab, B, A @ B), ("ABT", summa.abt, Bt, A @ Bt.t()),
                                  ("ATB", summa.atb, C, A.t() @ C)):
        g.log.reset()
        err[name] = excess(fn(g, blk(A), blk(other), "t", lowering=lowering), blk(want), RTOL, scaled_atol([want]))
        nbytes[name] = g.log.total()
    for name, fn, other in (("AB", summa.SummaAB, B), ("ABT", summa.SummaABT, Bt)):
        a = blk(A).requires_grad_()
        b = blk(other).requires_grad_()
        out = fn.apply(a, b, g, "t", lowering)
        Af, Of = A.clone().requires_grad_(), other.clone().requires_grad_()
        ref = Af @ (Of if name == "AB" else Of.t())
        W = torch.randn(ref.shape)  # a loss sum(W * out): its gradient is W
        (blk(W) * out).sum().backward()
        (W * ref).sum().backward()
        err[f"{name} dA"] = excess(a.grad, blk(Af.grad), RTOL, scaled_atol([Af.grad]))
        err[f"{name} dB"] = excess(b.grad, blk(Of.grad), RTOL, scaled_atol([Of.grad]))
    return {"excess": err, "bytes": nbytes}


LAYOUTS = [
    Layout((Replicate(), Replicate())),
    Layout((Shard(0), Shard(2))),
    Layout((Shard(2), Shard(0))),
    Layout((Shard(1), Replicate())),
    Layout((Replicate(), Shard(1))),
    Layout((Shard(0), Shard(1))),
    Layout((Partial("sum"), Shard(2))),
    Layout((Shard(0), Partial("sum"))),
    Layout((Partial("avg"), Replicate())),
]


def redistributions(rank, q):
    """Every (src, dst) pair: forward value equals dst's block of the full tensor, and the backward
    gives src's block of the full gradient (the engine's gradient invariant); {name: excess}."""
    g = _grid(q)
    torch.manual_seed(0)
    L = g.shape[0] * g.shape[1]
    full = torch.randn(2 * L, 3 * L, 2 * L)
    grad = torch.randn_like(full)
    atol = scaled_atol([full, grad], MOVE_ATOL_FRAC)
    errs = {}
    for src, dst in itertools.product(LAYOUTS, LAYOUTS):
        if any(isinstance(p, Partial) for p in dst.placements):
            continue  # a Partial target has no unique block to compare with
        x = block_of(full, src, g)
        if any(isinstance(p, Partial) and p.reduce_op == "avg" for p in src.placements):
            x = full.clone()  # every member holds the value; their average is it
        x.requires_grad_()
        y = kernels.Redistribute(g, src, dst, "t")(x)
        errs[f"{src!r} -> {dst!r} forward"] = excess(y, block_of(full, dst, g), MOVE_RTOL, atol)
        (y * block_of(grad, dst, g)).sum().backward()
        want = grad.clone()
        for axis, p in enumerate(src.placements):
            if isinstance(p, Shard):
                want = want.chunk(g.size(axis), dim=p.dim)[g.index(axis)]
            elif isinstance(p, Partial) and p.reduce_op == "avg":
                want = want / g.size(axis)
        errs[f"{src!r} -> {dst!r} backward"] = excess(x.grad, want, MOVE_RTOL, atol)
    return errs


def groups_shared(rank):
    """Threads of this process before and after building five grids of one shape and one of another,
    whether the same-shape grids share their groups, and a sum over the last grid's row group."""
    import os

    def threads():
        return len(os.listdir(f"/proc/{os.getpid()}/task"))

    Grid(2, 2), Grid(1, 4)  # whatever earlier checks built: these shapes exist from here on
    before = threads()
    grids = [Grid(2, 2) for _ in range(5)] + [Grid(1, 4)]
    t = torch.full((3,), float(rank))
    dist.all_reduce(t, group=grids[4].same_row_group)
    return {"new_threads": threads() - before, "shared": grids[0].same_row_group is grids[4].same_row_group
            and grids[0].mesh is grids[4].mesh, "sum": t.tolist()}
