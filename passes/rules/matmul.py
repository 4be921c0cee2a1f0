"""Matmuls. With a weight (a 2-D parameter, or a transpose of one) they become SUMMA products; between
two activations (attention written out by hand) they run locally on the batch/head blocks.

A weight W used as y = x W (math layout [K, N]) is stored either as blocks W[K-block r, N-block c]
(SUMMA AB, the default) or as W[N-block r, K-block c] (SUMMA ABT, what a weight tied to an embedding
table gets). nn.Linear's [out, in] = [N, K] storage is the second orientation of the same matrix.

A fused projection (one matmul whose output is then split into k equal parts: q|k|v, gate|up) stores
its N dim interleaved (`Strided(dim, k)`): column block c holds block c of every part, so the local
output splits into this rank's q, k and v blocks with no communication, while the parameter is still
the original matrix as a DTensor (a saved state dict has the original layout).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from passes.kernels.cube import CubeSpec
from passes.kernels.spec import SummaSpec
from passes.layout import REPLICATED, Layout, ShardingError, Strided, split_dim, uneven_ok
from passes.meta import CHOICE, PARAM
from passes.rules.registry import Strategy, Unsupported, kept_row_split, register
from passes.nodes import arg, shape, val
from passes.rules.moe import batched_experts
from passes.rules.weights import fused_parts, is_param

aten = torch.ops.aten


def _param_name(node) -> str:
    return node.meta.get(PARAM, node.name)


def _rows(node, x, layouts, mesh) -> tuple:
    """(x's placement over the mesh rows, the output's): x's own split of a lead dim if it has one,
    else the first lead dim divisible by the number of mesh rows; when none is (a ragged last batch),
    the first lead dim in torch.chunk blocks (indivisible='uneven'), or else x stays whole over the
    rows and every row computes all of it, the weight split as ever."""
    xs = shape(x)
    rows = kept_row_split(layouts.get(x), len(xs))
    if rows is None:
        ragged = Shard(0) if uneven_ok(mesh) and len(xs) > 1 and xs[0] > 0 else Replicate()
        rows = next((Shard(d) for d in range(len(xs) - 1) if xs[d] % mesh[0] == 0), ragged)
    if isinstance(rows, Replicate):
        return rows, rows
    return rows, Shard(rows.dim if rows.dim < len(val(node).shape) - 1 else 0)


def summa_strategy(node, layouts, mesh, x, w, bias, n_first: bool) -> Strategy:
    """x [..., K] times weight w ([N, K] if n_first else [K, N]) plus an optional bias [N]."""
    ws = shape(w)
    kd, nd = (1, 0) if n_first else (0, 1)
    K, N = ws[kd], ws[nd]
    R, C = mesh
    ab = Layout((Shard(kd), Shard(nd)))
    abt = Layout((Shard(nd), Shard(kd)))
    have = layouts.get(w)
    transposed = have == abt
    # x [.., K] splits K over the C columns; the output splits N over them; the weight splits its
    # first math dim (K for AB, N for ABT) over the R rows. Sizes the grid does not divide (a
    # vocabulary, a hidden size) are split in torch.chunk blocks when uneven splits are allowed
    if not uneven_ok(mesh) and (K % C or N % C or (N if transposed else K) % R):
        raise ShardingError(
            f"weight {_param_name(w)} of shape {tuple(ws)} cannot be split 2D on a {R}x{C} grid: "
            f"in-features {K} must be divisible by {C} (columns) and {R} (rows), out-features {N} by {C} (columns)"
            + (f" and {R} (rows; it is also used transposed)" if transposed else "")
        )
    k = fused_parts(node) if not transposed else 1
    fused = k > 1 and N % (k * C) == 0
    if fused:
        ab = Layout((Shard(kd), Strided(nd, split_factor=k)))
    w_lay = abt if transposed else ab
    rows, out_rows = _rows(node, x, layouts, mesh)
    last = len(shape(x)) - 1
    n_split = Strided(0, split_factor=k) if fused else Shard(0)
    need = {x: Layout((rows, Shard(last))), w: w_lay}
    if bias is not None:
        need[bias] = Layout((Replicate(), n_split))
    flip = n_first != transposed  # the local block must be transposed to be the operand SUMMA wants
    out_last = len(val(node).shape) - 1
    return Strategy(
        need,
        Layout((out_rows, Strided(out_last, split_factor=k) if fused else Shard(out_last))),
        kernel=SummaSpec(x=x, w=w, bias=bias, transposed=transposed, flip=flip,
                         rows_whole=isinstance(rows, Replicate)),
        note=("SUMMA ABT" if transposed else "SUMMA AB")
        + (f", fused x{k}: column blocks hold matching parts" if fused else "")
        + (", batch whole over the rows" if isinstance(rows, Replicate) else ""),
    )


def cube_strategy(node, layouts, mesh, x, w, bias, n_first: bool) -> Strategy:
    """strategy='3d' on a q x q x q cube, whose grid is (q, q*q) (`passes.mesh.Cube`): x [..., K] split
    rows over r and K over (c, l), the weight's K over (r, l) and its N over c (a cube layout of three
    placements, `passes.layout.cube_sizes`), the output in x's layout (`passes.ops.cube`). Sizes the
    cube does not divide (K or N by q*q), and a batch its rows do not split, run 2D SUMMA on the
    (q, q*q) grid instead, as the note says."""
    ws = shape(w)
    kd, nd = (1, 0) if n_first else (0, 1)
    K, N = ws[kd], ws[nd]
    q = mesh[0]
    rows, out_rows = _rows(node, x, layouts, mesh)
    xs = shape(x)
    whole = isinstance(rows, Replicate) or xs[rows.dim] % q
    if K % (q * q) or N % (q * q) or whole or mesh[1] != q * q:
        strat = summa_strategy(node, layouts, mesh, x, w, bias, n_first)
        why = (f"in-features {K} or out-features {N} not divisible by {q * q}" if K % (q * q) or N % (q * q)
               else f"a batch of {xs[0]} the {q} rows do not split")
        strat.note = f"{strat.note} (3D: {why}; 2D SUMMA on the {q}x{q * q} grid)"
        return strat
    last, out_last = len(xs) - 1, len(val(node).shape) - 1
    need = {x: Layout((rows, Shard(last))), w: Layout((Shard(kd), Shard(nd), Shard(kd)))}
    if bias is not None:
        need[bias] = Layout((Replicate(), Shard(0)))
    return Strategy(need, Layout((out_rows, Shard(out_last))), kernel=CubeSpec(x=x, w=w, bias=bias, flip=n_first),
                    note="3D: SUMMA over the depth's K/q, reduce-scatter over the depth")


def _is_weight(w, layouts) -> bool:
    """A 2-D operand that is an unplaced parameter (or a view of one), a parameter (or transpose of
    one) placed by an earlier use or by an earlier compile, or already split 2D."""
    if len(shape(w)) != 2:
        return False
    lay = layouts.get(w)
    return lay is None or is_param(w) or all(split_dim(p) is not None for p in lay.placements)


def one_d_strategy(node, layouts, mesh, x, w, bias, n_first: bool, kind: str) -> Strategy:
    """Megatron-style 1D tensor parallelism over the C mesh columns, with the batch split over the R
    rows (data parallel over the rows; the weight's gradient is all-reduced over them):

        col  x (rows, whole) . W split by out-features -> y (rows, out-features split)
        row  x (rows, in-features split) . W split by in-features -> y (rows, partial sum over columns)
        rep  x (rows, whole) . W whole -> y (rows, whole)

    The aten op runs unchanged on the local blocks; the insertion pass adds the all-reduces: the
    input's gradient over the columns for col (Megatron's f), the partial output when a consumer needs
    it whole (g), the weight's gradient over the rows.
    """
    R, C = mesh
    ws = shape(w)
    kd, nd = (1, 0) if n_first else (0, 1)
    K, N = ws[kd], ws[nd]
    last = len(shape(x)) - 1
    uneven = uneven_ok(mesh)  # sizes the columns do not divide split in torch.chunk blocks
    if kind == "1d":
        lay = layouts.get(x)
        split_in = lay is not None and split_dim(lay.normalized(last + 1)[1]) == last
        kind = "row" if split_in and (K % C == 0 or uneven) else "col"
    rows, out_rows = _rows(node, x, layouts, mesh)
    if R == 1 and kept_row_split(layouts.get(x), len(shape(x))) is None:
        # one row: a split over it is no split, but it would hold the token dim the columns split
        # between blocks (sequence parallelism) and push their split onto a batch of one
        rows = out_rows = Replicate()
    out_last = len(val(node).shape) - 1
    if kind == "col":
        k = fused_parts(node)
        fused = k > 1 and N % (k * C) == 0
        if N % C and not uneven:
            raise ShardingError(f"weight {_param_name(w)} of shape {tuple(ws)}: out-features {N} not divisible "
                                f"by the {C} mesh columns (1D column split)")
        n_split = (lambda d: Strided(d, split_factor=k)) if fused else Shard
        need = {x: Layout((rows, Replicate())), w: Layout((Replicate(), n_split(nd)))}
        if bias is not None:
            need[bias] = Layout((Replicate(), n_split(0)))
        note = "1D column split" + (f", fused x{k}" if fused else "")
        return Strategy(need, Layout((out_rows, n_split(out_last))), note=note)
    if kind == "row":
        if K % C and not uneven:
            raise ShardingError(f"weight {_param_name(w)} of shape {tuple(ws)}: in-features {K} not divisible "
                                f"by the {C} mesh columns (1D row split)")
        need = {x: Layout((rows, Shard(last))), w: Layout((Replicate(), Shard(kd)))}
        if bias is not None:  # added once: by column 0 of the partial sum
            need[bias] = Layout((Replicate(), Partial("sum")))
        return Strategy(need, Layout((out_rows, Partial("sum"))), note="1D row split (partial over columns)")
    need = {x: Layout((rows, Replicate())), w: REPLICATED}
    if bias is not None:
        need[bias] = REPLICATED
    return Strategy(need, Layout((out_rows, Replicate())), note="weight replicated")


def _placed_kind(lay: Layout, n_first: bool, choice: str) -> str:
    """The strategy a weight already placed (by an earlier use such as a tied table, or pinned by an
    earlier compile) runs under: a 1D layout its 1D split, anything else SUMMA (which redistributes a
    layout it cannot use); a whole weight stays whole where the strategy chose that."""
    kd, nd = (1, 0) if n_first else (0, 1)
    if len(lay.placements) == 3:  # a cube layout (strategy='3d')
        return "3d"
    rows, cols = lay.normalized(2).placements
    if isinstance(rows, Replicate) and split_dim(cols) == nd:
        return "col"
    if isinstance(rows, Replicate) and cols == Shard(kd):
        return "row"
    return "rep" if lay.is_replicated and choice == "rep" else "2d"


def weight_strategy(node, layouts, mesh, x, w, bias, n_first: bool) -> Strategy:
    """The strategy `node.meta[CHOICE]` names (default: 2D SUMMA) for an unplaced weight; a
    weight already placed keeps its layout's strategy (`_placed_kind`)."""
    choice = node.meta.get(CHOICE, "2d")
    if layouts.get(w) is not None:
        choice = _placed_kind(layouts[w], n_first, choice)
    if choice == "2d":
        return summa_strategy(node, layouts, mesh, x, w, bias, n_first)
    if choice == "3d":
        return cube_strategy(node, layouts, mesh, x, w, bias, n_first)
    return one_d_strategy(node, layouts, mesh, x, w, bias, n_first, choice)


@register(aten.linear.default)
def linear(node, layouts, mesh):
    x, w = node.args[0], node.args[1]
    bias = arg(node, 2, "bias")
    placed_1d = layouts.get(w) is not None and len(shape(w)) == 2 and _placed_kind(layouts[w], True, "2d") != "2d"
    if not (placed_1d or _is_weight(w, layouts)):
        raise Unsupported("linear whose weight is not a 2-D parameter")
    return weight_strategy(node, layouts, mesh, x, w, bias, n_first=True)


@register(aten.addmm.default)
def addmm(node, layouts, mesh):
    bias, x, w = node.args[:3]
    if node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1 or len(shape(bias)) != 1:
        raise Unsupported("addmm with beta/alpha or a 2-D bias")
    if not _is_weight(w, layouts):
        return batched_local(node, layouts, mesh, x, w)
    return weight_strategy(node, layouts, mesh, x, w, bias, n_first=False)


@register(aten.mm.default, aten.matmul.default, aten.bmm.default)
def matmul(node, layouts, mesh):
    a, b = node.args[:2]
    if batched_experts.applies(node):
        return batched_experts.batched_experts(node, layouts, mesh)
    if len(shape(a)) >= 2 and _is_weight(b, layouts):
        return weight_strategy(node, layouts, mesh, a, b, None, n_first=False)
    return batched_local(node, layouts, mesh, a, b)


@register(aten.baddbmm.default)
def baddbmm(node, layouts, mesh):
    inp, a, b = node.args[:3]
    strat = batched_local(node, layouts, mesh, a, b)
    out_lay = strat.output
    # the added tensor broadcasts against the [batch, m, n] output
    off = len(val(node).shape) - len(shape(inp))
    ps = []
    for p in out_lay.placements:
        d = p.dim - off if isinstance(p, Shard) else None
        ps.append(Shard(d) if d is not None and d >= 0 and shape(inp)[d] != 1 else Replicate())
    strat.inputs[inp] = Layout(tuple(ps))
    return strat


def batched_local(node, layouts, mesh, a, b) -> Strategy:
    """Activation @ activation: split batch dims stay split (the same way on both), matrix dims whole."""
    out_shape = tuple(val(node).shape)
    nout = len(out_shape)
    if nout < 3:
        raise Unsupported("matmul of two activations without batch dims")
    sa, sb = shape(a), shape(b)
    maps = {a: {d: d + nout - len(sa) for d in range(len(sa) - 2)},
            b: {d: d + nout - len(sb) for d in range(len(sb) - 2)}}
    chosen = []
    for axis in range(2):
        pick = None
        for n in (a, b):
            lay = layouts.get(n)
            p = lay.normalized(len(shape(n)))[axis] if lay is not None else None
            if isinstance(p, Shard) and p.dim in maps[n]:
                od = maps[n][p.dim]
                if shape(n)[p.dim] == out_shape[od] and od not in chosen and out_shape[od] % mesh[axis] == 0:
                    pick = od
                    break
        chosen.append(pick)
    out = Layout(tuple(Shard(d) if d is not None else Replicate() for d in chosen))
    need = {}
    for n in (a, b):
        inv = {o: i for i, o in maps[n].items() if shape(n)[i] == out_shape[o]}
        need[n] = Layout(tuple(Shard(inv[d]) if d in inv else Replicate() for d in chosen))
    return Strategy(need, out, note="local batched matmul")
