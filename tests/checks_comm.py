"""Rank-side checks of the collective layer: groups, SUMMA products and redistributions against
brute-force results computed from the full tensors (identical on every rank: same seed)."""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist
from torch.distributed.tensor import Partial, Replicate, Shard

from passes.layout import Layout
from passes.mesh import Grid
from passes.ops import comm, summa
from passes.ops import modules as kernels
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


class _Events:
    """An event log of the collectives this rank launches: ("post", name) when one is launched, ("wait",
    name) when its work is waited for (a call that is not async: both at once). Installed over the
    functions `passes.ops.comm` calls (`dist.broadcast`, `dist.reduce`, its all-gather and reduce-scatter)."""

    NAMES = (("dist", "broadcast"), ("dist", "reduce"), ("comm", "all_gather_single"),
             ("comm", "reduce_scatter_single"))

    def __init__(self):
        self.log: list = []

    def __enter__(self):
        self.saved = []
        for where, name in self.NAMES:
            owner = dist if where == "dist" else comm
            fn = getattr(owner, name)
            self.saved.append((owner, name, fn))
            setattr(owner, name, self._wrap(name, fn))
        return self

    def __exit__(self, *exc):
        for owner, name, fn in self.saved:
            setattr(owner, name, fn)

    def _wrap(self, name, fn):
        events = self.log

        class Work:
            def __init__(self, work):
                self.work = work

            def wait(self):
                events.append(("wait", name))
                return self.work.wait()

        def call(*args, async_op=False, **kwargs):
            events.append(("post", name))
            work = fn(*args, async_op=async_op, **kwargs)
            if not async_op:
                events.append(("wait", name))
                return work
            return Work(work)

        return call


def gathers_in_flight(events: list) -> int:
    """Broadcasts and all-gathers launched while a reduce or reduce-scatter is in flight."""
    open_, n = {"reduce": 0, "reduce_scatter_single": 0}, 0
    for kind, name in events:
        if name in open_:
            open_[name] += 1 if kind == "post" else -1
        elif kind == "post" and any(open_.values()):
            n += 1
    return n


def overlap_events(rank, lowering):
    """One backward of SummaAB, SummaABT and (all-gather lowering) a group of two sibling products on a
    2x2 grid, with the grid's `overlap_grad_reduce` on and off: per product and setting, how many of
    the backward's broadcasts and all-gathers were launched while a weight-gradient reduction was in
    flight; whether the gradients, bytes and launches are identical in both settings."""
    from passes.ops.summa_group import SummaGroup

    g = Grid(2, 2)
    torch.manual_seed(0)
    x, w_ab, w_abt, w2 = torch.randn(8, 4), torch.randn(4, 3), torch.randn(3, 4), torch.randn(4, 5)  # K = 8, N = 6
    cases = {"AB": lambda x, w: summa.SummaAB.apply(x, w, g, "t", lowering),
             "ABT": lambda x, w: summa.SummaABT.apply(x, w, g, "t", lowering)}
    weights = {"AB": (w_ab,), "ABT": (w_abt,)}
    if lowering == "allgather":
        group = SummaGroup(g, (False, False), ("t", "u"))
        cases["group"] = lambda x, *ws: torch.cat(group(x, *ws), 1)
        weights["group"] = (w_ab, w2)
    out, same = {}, {}
    for name, fn in cases.items():
        runs = []
        for overlap in (True, False):
            g.overlap_grad_reduce = overlap
            xs, ws = x.clone().requires_grad_(), [w.clone().requires_grad_() for w in weights[name]]
            y = fn(xs, *ws)
            g.log.reset()
            with _Events() as ev:
                y.backward(torch.ones_like(y))
            runs.append((xs.grad, [w.grad for w in ws], dict(g.log.bytes), dict(g.log.launches)))
            out[(name, overlap)] = gathers_in_flight(ev.log)
        (gx, gws, nb, nl), (hx, hws, mb, ml) = runs
        same[name] = torch.equal(gx, hx) and all(map(torch.equal, gws, hws)) and (nb, nl) == (mb, ml)
    g.overlap_grad_reduce = True
    return {"in flight": out, "same": same}


def ring_against_broadcast(rank, grid, M, K, N):
    """AB, ABT and ATB of [M, K] blocks (torch.chunk blocks where the grid does not divide a dim) in
    the ring and the broadcast lowering: {product: excess of each against torch, bytes each received,
    point-to-point batches the ring launched, and what the schedule plans for this rank}."""
    from passes.cost.rotation import product_calls
    from passes.cost.summa_blocks import product_elems

    g = _grid(grid)
    torch.manual_seed(0)
    at = (g.r, g.c)
    A, B, Bt, Cm = torch.randn(M, K), torch.randn(K, N), torch.randn(N, K), torch.randn(M, N)
    split = Layout((Shard(0), Shard(1)))
    blk = lambda t: block_of(t, split, g)  # noqa: E731
    out = {}
    for name, fn, other, want, full in (("ab", summa.ab, B, A @ B, K), ("abt", summa.abt, Bt, A @ Bt.t(), N),
                                        ("atb", summa.atb, Cm, A.t() @ Cm, K)):
        row = {}
        for lowering in ("broadcast", "ring"):
            g.log.reset()
            got = fn(g, blk(A), blk(other), "t", lowering=lowering, full=full)
            row[lowering] = {"excess": excess(got, blk(want), RTOL, scaled_atol([want])), "bytes": g.log.total(),
                             "calls": g.log.calls()}
        m = blk(A).shape[0]
        row["planned bytes"] = 4 * sum(e for _, e in product_elems(name, "ring", g.shape, at, m, K, N))
        row["planned calls"] = product_calls(name, g.shape, at, K, N)
        out[name] = row
    return out


class _Transfers:
    """A log of this rank's panel transfers and matmuls, in program order: ("post", n) when n transfers are
    launched (a broadcast, or a batch of point-to-point sends and receives), ("wait", 1) when one is waited
    for, ("mm", 0) for each matmul. Installed over `dist.broadcast`, `dist.batch_isend_irecv` and the
    tensor methods the lowerings multiply with (`addmm_`, `@`), and the all-gather `passes.ops.comm` calls."""

    def __init__(self):
        self.log: list = []

    def __enter__(self):
        log = self.log

        class Work:
            def __init__(self, work):
                self.work = work

            def wait(self):
                log.append(("wait", 1))
                return self.work.wait()

        def collective(fn):
            def run(*args, async_op=False, **kwargs):
                log.append(("post", 1))
                work = fn(*args, async_op=async_op, **kwargs)
                if not async_op:
                    log.append(("wait", 1))
                    return work
                return Work(work)
            return run

        def batch(ops):
            works = self.saved[1](ops)
            log.append(("post", len(works)))
            return [Work(w) for w in works]

        def matmul(fn):
            def run(*args, **kwargs):
                log.append(("mm", 0))
                return fn(*args, **kwargs)
            return run

        self.saved = (dist.broadcast, dist.batch_isend_irecv, torch.Tensor.addmm_, torch.Tensor.__matmul__,
                      comm.all_gather_single)
        dist.broadcast, dist.batch_isend_irecv = collective(self.saved[0]), batch
        comm.all_gather_single = collective(self.saved[4])
        torch.Tensor.addmm_, torch.Tensor.__matmul__ = matmul(self.saved[2]), matmul(self.saved[3])
        return self

    def __exit__(self, *exc):
        (dist.broadcast, dist.batch_isend_irecv, torch.Tensor.addmm_, torch.Tensor.__matmul__,
         comm.all_gather_single) = self.saved

    def most_in_flight(self) -> int:
        """The most transfers launched and not yet waited for at any point."""
        open_, most = 0, 0
        for kind, n in self.log:
            open_ += n if kind == "post" else -n if kind == "wait" else 0
            most = max(most, open_)
        return most

    def in_flight_at_matmuls(self) -> list:
        """How many transfers were launched and not yet waited for at each matmul."""
        open_, out = 0, []
        for kind, n in self.log:
            if kind == "mm":
                out.append(open_)
            else:
                open_ += n if kind == "post" else -n
        return out


def prefetch_events(rank, lowering):
    """AB, ABT and ATB on a 2x2 grid with K, N = 8 (two panels each), forward and backward, with the grid's
    `prefetch` (and `overlap_grad_reduce`, as the `overlap` option sets them) on and off: per product and
    setting, the transfers in flight at each matmul; whether results, gradients, bytes and launches are
    identical in both settings."""
    g = Grid(2, 2)
    torch.manual_seed(0)
    x, w_ab, w_abt = torch.randn(8, 4), torch.randn(4, 4), torch.randn(4, 4)
    cases = {"AB": lambda x, w: summa.SummaAB.apply(x, w, g, "t", lowering),
             "ABT": lambda x, w: summa.SummaABT.apply(x, w, g, "t", lowering),
             "ATB": lambda x, w: summa.atb(g, x, w, "t", lowering=lowering)}
    weights = {"AB": w_ab, "ABT": w_abt, "ATB": torch.randn(8, 4)}
    out, same, most = {}, {}, {}
    for name, fn in cases.items():
        runs = []
        for on in (True, False):
            g.prefetch = g.overlap_grad_reduce = on
            grad = name != "ATB"  # ATB alone (not an autograd op): forward only; it is AB's and ABT's dW backward
            xs, ws = x.clone().requires_grad_(grad), weights[name].clone().requires_grad_(grad)
            g.log.reset()
            with _Transfers() as ev:
                y = fn(xs, ws)
                if y.requires_grad:
                    y.backward(torch.ones_like(y))
            runs.append((y.detach(), xs.grad, ws.grad, dict(g.log.bytes), dict(g.log.launches)))
            out[(name, on)] = ev.in_flight_at_matmuls()
            most[(name, on)] = ev.most_in_flight()

        def equal(a, b):
            return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))

        (*first, nb, nl), (*second, mb, ml) = runs
        same[name] = all(equal(a, b) for a, b in zip(first, second)) and (nb, nl) == (mb, ml)
    g.prefetch = g.overlap_grad_reduce = True
    return {"in flight": out, "same": same, "most": most}
