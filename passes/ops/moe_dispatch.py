"""Expert parallelism with the tokens split over the grid's rows: the token dispatch and the combine.

The routed region of a transformers 5 `*Experts` layer (`passes.transforms.route_experts` rewrites it) becomes
three ops of ours around the two grouped matmuls, each with its global meaning (what one process
computes, and what the fallback runs whole) and its kernel on an R x C grid, where row r holds the
tokens [T/R, H/C] it routed (hidden dim over the columns) and the experts chunk_range(E, R, r):

- `moe_offsets(ids [Tk], E)` -> the grouped matmul's offsets [E] (int32): every expert's end row in
  the pairs sorted by expert. Kernel: this row's counts, all-reduced over the rows.
- `moe_dispatch(h [T, H], ids [Tk], k, E)` -> h's rows of the (token, slot) pairs sorted by expert
  (stably), [Tk, H]. Kernel (`Dispatch`): sort this row's pairs, send each pair's [H/C] block to the
  row that owns its expert (one all-to-all over the rows, within each column), regroup what arrived
  by expert, all-gather the columns' blocks ([n, H/C] -> [n, H]: the first matmul splits each
  expert's intermediate dim over the columns and reads H whole), place the run at its global rows.
  The result is `P(rows)` (`passes.rules.moe.expert_rows`): row r holds the global rows of its experts.
- `moe_combine(y [Tk, H], w [Tk], ids [Tk], k, E)` -> [T, H]: y's rows back in pair order, times the
  routing weights, summed over the k slots. Kernel (`Combine`): reduce-scatter the run over the
  columns (y is a column partial sum, the down projection's I blocks), all-to-all each pair's block
  back to the row that routed it, weight and sum there: [T/R, H/C], the activations' own layout.

Backward runs the transposed collectives (reduce-scatter for the all-gather and the reverse). The
pairs of one expert arrive ordered by source row, then by pair: the global stable sort's order, so the
run is exactly those global rows. Sizes depend on the routing; the planner prices them as balanced
(`passes.rules.moe.routing`), the collectives count what they really move.

>>> ids = torch.tensor([1, 0, 1, 1])  # two tokens, top-2: token 0 -> experts 1, 0; token 1 -> 1, 1
>>> torch.ops.autopar.moe_offsets(ids, 3).tolist()
[1, 4, 4]
>>> h = torch.tensor([[1.], [2.]])
>>> torch.ops.autopar.moe_dispatch(h, ids, 2, 3).flatten().tolist()  # pairs by expert: 1 | 0, 2, 3
[1.0, 1.0, 2.0, 2.0]
>>> torch.ops.autopar.moe_combine(torch.ones(4, 1), torch.full((4,), .5), ids, 2, 3).flatten().tolist()
[1.0, 1.0]
"""

from __future__ import annotations

import itertools
import math

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from passes.compat import is_fake
from passes.cost.volumes import all_to_all_bytes
from passes.layout import chunk_range
from passes.mesh import Grid
from passes.ops import comm

ROWS, COLS = 0, 1


def _counts(ids: torch.Tensor, experts: int) -> torch.Tensor:
    """Pairs per expert [E] (int64), with no data-dependent shape (a fake run of the kernels has none)."""
    return ids.new_zeros(experts).index_add_(0, ids, torch.ones_like(ids))


def _order(ids: torch.Tensor) -> torch.Tensor:
    """The pairs sorted by expert, ties in pair order (what makes a row's run the global rows)."""
    return torch.sort(ids, stable=True).indices


@torch.library.custom_op("autopar::moe_offsets", mutates_args=())
def moe_offsets(ids: torch.Tensor, experts: int) -> torch.Tensor:
    return _counts(ids, experts).cumsum(0).to(torch.int32)


@moe_offsets.register_fake
def _(ids, experts):
    return ids.new_empty((experts,), dtype=torch.int32)


@torch.library.custom_op("autopar::moe_dispatch", mutates_args=())
def moe_dispatch(h: torch.Tensor, ids: torch.Tensor, k: int, experts: int) -> torch.Tensor:
    return h[_order(ids) // k].clone()


@moe_dispatch.register_fake
def _(h, ids, k, experts):
    return h.new_empty((ids.shape[0], h.shape[-1]))


def _dispatch_setup(ctx, inputs, output):
    h, ids, k, _ = inputs
    ctx.save_for_backward(ids)
    ctx.k, ctx.tokens = k, h.shape[0]


def _dispatch_backward(ctx, g):
    (ids,) = ctx.saved_tensors
    return g.new_zeros((ctx.tokens, g.shape[-1])).index_add(0, _order(ids) // ctx.k, g), None, None, None


moe_dispatch.register_autograd(_dispatch_backward, setup_context=_dispatch_setup)


@torch.library.custom_op("autopar::moe_combine", mutates_args=())
def moe_combine(y: torch.Tensor, w: torch.Tensor, ids: torch.Tensor, k: int, experts: int) -> torch.Tensor:
    pairs = torch.empty_like(y)
    pairs[_order(ids)] = y  # [Tk, H] in pair order
    return (pairs * w.unsqueeze(-1)).view(-1, k, y.shape[-1]).sum(1)  # in y's and w's promoted dtype, as captured


@moe_combine.register_fake
def _(y, w, ids, k, experts):
    return y.new_empty((ids.shape[0] // k, y.shape[-1]), dtype=torch.promote_types(y.dtype, w.dtype))


def _combine_setup(ctx, inputs, output):
    y, w, ids, k, _ = inputs
    ctx.save_for_backward(y, w, ids)
    ctx.k = k


def _combine_backward(ctx, g):
    y, w, ids = ctx.saved_tensors
    order = _order(ids)
    gp = g.repeat_interleave(ctx.k, 0)  # [Tk, H]: each pair's share of its token's gradient
    gw = (gp * y[torch.argsort(order)]).sum(-1).to(w.dtype)
    return (gp * w.unsqueeze(-1)).to(y.dtype)[order], gw, None, None, None


moe_combine.register_autograd(_combine_backward, setup_context=_combine_setup)


def all_to_all(grid: Grid, axis: int, t: torch.Tensor, send: list, recv: list, tag: str, phase: str) -> torch.Tensor:
    """Send rows send[i] of `t` (consecutive runs) to member i, receive recv[i] rows from member i, in
    member order. Counts the bytes received from the other members."""
    out = t.new_empty((sum(recv),) + tuple(t.shape[1:]))
    if grid.size(axis) == 1:
        return t.clone()
    if is_fake(t):  # a planning run: shapes only
        return out
    row = math.prod(t.shape[1:]) * t.element_size()
    grid.log.add(tag, phase, all_to_all_bytes(recv, grid.index(axis), row))
    grid.log.launch(tag, phase)
    with comm.guarded(grid, "all-to-all", axis, tag):
        dist.all_to_all_single(out, t.contiguous(), output_split_sizes=recv, input_split_sizes=send,
                               group=grid.group(axis))
    return out


class Routing:
    """Where this row's pairs go and what it receives, from every row's counts per expert (one small
    all-gather over the rows). `order`: this row's pairs sorted by expert; `send[d]`/`recv[s]`: rows to
    row d / from row s; `regroup`: the received rows (by source, then expert) in expert order;
    `start`, `total`: this row's run in the globally sorted pairs, and their number."""

    def __init__(self, grid: Grid, ids: torch.Tensor, experts: int, tag: str, phase: str):
        R, me = grid.size(ROWS), grid.index(ROWS)
        self.order = _order(ids)
        if is_fake(ids):  # a planning run has no routing to read: take it balanced, as the costs do
            self._balanced(len(ids), R, me)
            return
        counts = _counts(ids, experts).unsqueeze(0)  # [1, E]
        # the routing's one host read: every row's pairs per expert, the all-to-all's split sizes (on an
        # accelerator a sync the exchange cannot do without: its sizes are given on the host)
        table = comm.all_gather(grid, ROWS, counts, 0, tag, phase).tolist()  # [R][E]
        edges = [chunk_range(experts, R, d) for d in range(R)]
        lo, hi = edges[me]
        self.send = [sum(table[me][a:b]) for a, b in edges]
        mine = [row[lo:hi] for row in table]  # [R][E/R]: pairs from row s for my expert e
        self.recv = [sum(row) for row in mine]
        self.start, self.total = sum(sum(row[:lo]) for row in table), sum(map(sum, table))
        self.n = sum(self.recv)
        # received rows are by source row, then expert; `regroup` puts them expert-major: the run of
        # (s, e) starts at the rows received before it, built on the device from the E numbers
        sizes = [n for row in mine for n in row]
        starts = [0, *itertools.accumulate(sizes)][:-1]
        E = hi - lo
        order = [s * E + e for e in range(E) for s in range(R)]
        lengths = ids.new_tensor([sizes[i] for i in order])
        begin = ids.new_tensor([starts[i] for i in order])
        at = torch.cumsum(lengths, 0) - lengths  # where each run starts in the regrouped order
        self.regroup = (torch.arange(self.n, device=ids.device)
                        + torch.repeat_interleave(begin - at, lengths, output_size=self.n))

    def _balanced(self, pairs: int, R: int, me: int) -> None:
        self.send = [hi - lo for lo, hi in (chunk_range(pairs, R, d) for d in range(R))]
        self.recv = self.send[me:me + 1] * R
        self.n, self.start, self.total = sum(self.recv), me * pairs, R * pairs
        self.regroup = torch.arange(self.n, device=self.order.device)

    def to_experts(self, grid, x, tag, phase):
        """[pairs sorted, K] of this row -> [n, K] of its experts' pairs, expert-major."""
        return all_to_all(grid, ROWS, x, self.send, self.recv, tag, phase)[self.regroup]

    def to_tokens(self, grid, x, tag, phase):
        """The transpose of `to_experts`: [n, K] expert-major -> [pairs sorted, K] of this row."""
        back = torch.empty_like(x)
        back[self.regroup] = x
        return all_to_all(grid, ROWS, back, self.recv, self.send, tag, phase)


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, ids, grid, k, experts, tag):
        route = Routing(grid, ids, experts, tag, "fwd")
        got = route.to_experts(grid, h[route.order // k], tag, "fwd")  # [n, H/C]
        whole = comm.all_gather(grid, COLS, got, 1, tag, "fwd")  # [n, H]
        ctx.grid, ctx.k, ctx.tag, ctx.route, ctx.tokens = grid, k, tag, route, h.shape[0]
        return F.pad(whole, (0, 0, route.start, route.total - route.start - route.n))  # [Tk, H] P(rows)

    @staticmethod
    def backward(ctx, g):
        route, grid = ctx.route, ctx.grid
        run = g[route.start:route.start + route.n]  # [n, H], a partial sum over the columns
        mine = comm.reduce_scatter(grid, COLS, run, 1, ctx.tag, "bwd")  # [n, H/C]
        back = route.to_tokens(grid, mine, ctx.tag, "bwd")  # [pairs sorted, H/C]
        gh = back.new_zeros((ctx.tokens, back.shape[-1])).index_add(0, route.order // ctx.k, back)
        return gh, None, None, None, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, w, ids, grid, k, experts, tag):
        route = Routing(grid, ids, experts, tag, "fwd")
        run = comm.reduce_scatter(grid, COLS, y[route.start:route.start + route.n], 1, tag, "fwd")  # [n, H/C]
        pairs = torch.empty((len(ids), run.shape[-1]), dtype=run.dtype, device=run.device)
        pairs[route.order] = route.to_tokens(grid, run, tag, "fwd")  # [Tk/R, H/C] in pair order
        ctx.save_for_backward(pairs, w)
        ctx.grid, ctx.k, ctx.tag, ctx.route, ctx.total = grid, k, tag, route, y.shape[0]
        return (pairs * w.unsqueeze(-1)).view(-1, k, pairs.shape[-1]).sum(1)

    @staticmethod
    def backward(ctx, g):
        pairs, w = ctx.saved_tensors
        route, grid = ctx.route, ctx.grid
        gp = g.repeat_interleave(ctx.k, 0)  # [Tk/R, H/C]
        gw = (gp * pairs).sum(-1).to(w.dtype)  # a partial sum over the columns: the GradSync of w adds them
        sent = route.to_experts(grid, (gp * w.unsqueeze(-1)).to(pairs.dtype)[route.order], ctx.tag, "bwd")
        whole = comm.all_gather(grid, COLS, sent, 1, ctx.tag, "bwd")  # [n, H]
        gy = F.pad(whole, (0, 0, route.start, ctx.total - route.start - route.n))
        return gy, gw, None, None, None, None, None


class ExpertOffsets(nn.Module):
    """`moe_offsets` on this row's pairs: counts all-reduced over the rows, then their running sum."""

    def __init__(self, grid: Grid, experts: int, tag: str):
        super().__init__()
        self.grid, self.experts, self.tag = grid, experts, tag

    def forward(self, ids):
        counts = _counts(ids, self.experts)
        return comm.all_reduce(self.grid, ROWS, counts, self.tag, "fwd").cumsum(0).to(torch.int32)


class ExpertDispatch(nn.Module):
    """`moe_dispatch` on the grid: h [T/R, H/C], ids [Tk/R] -> [Tk, H], this row's run, zeros elsewhere."""

    def __init__(self, grid: Grid, k: int, experts: int, tag: str):
        super().__init__()
        self.grid, self.k, self.experts, self.tag = grid, k, experts, tag

    def forward(self, h, ids):
        return _Dispatch.apply(h, ids, self.grid, self.k, self.experts, self.tag)

    def extra_repr(self) -> str:
        return f"k={self.k}, experts={self.experts}"


class ExpertCombine(nn.Module):
    """`moe_combine` on the grid: y [Tk, H] (this row's run, a partial sum over the columns), w and ids
    [Tk/R] -> [T/R, H/C]."""

    def __init__(self, grid: Grid, k: int, experts: int, tag: str):
        super().__init__()
        self.grid, self.k, self.experts, self.tag = grid, k, experts, tag

    def forward(self, y, w, ids):
        return _Combine.apply(y, w, ids, self.grid, self.k, self.experts, self.tag)

    def extra_repr(self) -> str:
        return f"k={self.k}, experts={self.experts}"
