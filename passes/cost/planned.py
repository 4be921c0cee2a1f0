"""Planned communication of the inserted modules: bytes received per rank, forward and backward, as
sympy expressions in the grid shape R x C, the element size e and the sizes the module moves. A
collective over mesh axis 0 has R members, one over axis 1 has C (written g below). Each module's
bytes are its spec's (`passes.kernels.spec`); this module holds the SUMMA volumes, the layout-to-layout
walk (which the runtime `Redistribute` runs) and `node_cost`.

Each collective's bytes are `passes.cost.volumes`', the same functions the collective layer counts
with, so for a training step the numbers equal what it counts at run time -- a test runs a real step
and compares. Requires `KERNEL`, `LAYOUT` and `val` in the meta of the inserted nodes and
`LAYOUT` and `val` in their inputs' (keys from `passes.meta`).

>>> import sympy
>>> M, K, N = sympy.symbols("M K N", positive=True)
>>> summa_ab_bytes(M, K, N)[0]
e*(K*M*(C - 1) + K*N*(R - 1))/(C*R)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import sympy
import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.fx import Node

from passes.cost.volumes import all_gather_bytes, all_reduce_bytes, reduce_scatter_bytes, regroup_bytes
from passes.layout import Layout, local_shape, parts, split_dim
from passes.meta import KERNEL, ROLE

R, C, E = sympy.symbols("R C e", positive=True, integer=True)  # mesh axis 0 has R members, axis 1 C


@dataclass
class Cost:
    collectives: str
    fwd_expr: sympy.Expr = sympy.Integer(0)
    bwd_expr: sympy.Expr = sympy.Integer(0)
    values: dict = field(default_factory=dict)  # symbol -> number

    @property
    def fwd(self) -> int:
        return int(self.fwd_expr.subs(self.values))

    @property
    def bwd(self) -> int:
        return int(self.bwd_expr.subs(self.values))

    @property
    def formula(self) -> str:
        if self.fwd_expr == 0 and self.bwd_expr == 0:
            return ""
        vals = ", ".join(f"{k}={v}" for k, v in self.values.items())
        return f"fwd {self.fwd_expr}; bwd {self.bwd_expr}  [{vals}]"


def summa_axis_elems(M, K, N, R, C, transposed: bool) -> tuple:
    """Elements times R*C that one SUMMA product of a linear x [M, K] . W -> [M, N] receives per rank
    over mesh axis 0 and over axis 1 (the three products of a training step receive the same). AB
    gathers the rest of a [M/R, K] row panel of x over the C columns and of a [K, N/C] column panel of
    W over the R rows; ABT (W stored [N, K]) moves W's panel over the rows and reduces the [M/R, N]
    output over the columns. Numbers or sympy symbols alike."""
    if transposed:
        return (R - 1) * K * N, (C - 1) * M * N
    return (R - 1) * K * N, (C - 1) * M * K


def summa_ab_bytes(M, K, N, grads=2):
    """AB forward, then ABT (for dX) and ATB (for dW) backward, e ((C-1) MK + (R-1) KN) / RC each.
    `grads` says how many of the two backward products run (an input without gradient skips ABT).
    Square q x q: (q-1)/q^2 (MK + KN) e."""
    one = E * sum(summa_axis_elems(M, K, N, R, C, False)) / (R * C)
    return one, grads * one


def summa_abt_bytes(M, K, N, grads=2):
    """ABT forward (broadcast W over the rows, reduce Y over the columns), then AB + ATB backward:
    e ((R-1) KN + (C-1) MN) / RC each."""
    one = E * sum(summa_axis_elems(M, K, N, R, C, True)) / (R * C)
    return one, grads * one


def redistribution(src, dst) -> tuple:
    """The collectives `kernels.Redistribute(src -> dst)` runs, in order, as (kind, axis, dim, parts,
    avg) tuples of plain values (torch.compile cannot trace into placement objects): first gather the
    axes whose split changes, then split, reduce or reduce-scatter axis by axis, so two axes never
    split one dim in between; an axis that only moves a dim between plain and interleaved blocks
    regroups it in one all-to-all. `kind`: "gather", "reduce-scatter", "all-reduce", "split",
    "to-partial", "regroup" or "ungroup"; `dim`: the tensor dim gathered or split (-1: none); `parts`: a Strided split's
    interleaved parts; `avg`: the partial sum (reduced or made) is an average. The runtime runs this
    list and `redistribute_steps` prices it, so what runs is what was priced.

    >>> from passes.layout import Layout
    >>> redistribution(Layout((Partial(), Shard(0))), Layout((Shard(1), Replicate())))
    (('gather', 1, 0, 1, False), ('reduce-scatter', 0, 1, 1, False))
    """
    steps, cur = [], list(src.placements)
    regrouped = {a for a in range(2) if _regroups(src, dst, a)}
    for a in range(2):
        if split_dim(cur[a]) is not None and cur[a] != dst[a] and a not in regrouped:
            steps.append(("gather", a, cur[a].dim, parts(cur[a]), False))
            cur[a] = Replicate()
    for a in range(2):
        s, d = cur[a], dst[a]
        if s == d:
            continue
        if a in regrouped:  # plain <-> interleaved blocks of one dim: one all-to-all, no gather
            k = max(parts(s), parts(d))
            steps.append(("regroup" if parts(d) > 1 else "ungroup", a, d.dim, k, False))
            continue
        if isinstance(s, Partial):
            avg = s.reduce_op == "avg"
            if isinstance(d, Shard) and parts(d) == 1:
                steps.append(("reduce-scatter", a, d.dim, 1, avg))
                continue
            steps.append(("all-reduce", a, -1, 1, avg))
        if split_dim(d) is not None:
            steps.append(("split", a, d.dim, parts(d), False))
        elif isinstance(d, Partial):
            steps.append(("to-partial", a, -1, 1, d.reduce_op == "avg"))
    return tuple(steps)


def _regroups(src, dst, a: int) -> bool:
    """Axis `a` moves one dim between plain and interleaved (Strided) blocks, which the other axis
    leaves alone (`passes.ops.reblock.regroup`): a fused projection's weight stored as plain blocks
    (fused='regroup') read interleaved, and its gradient back."""
    s, d = src.placements[a], dst.placements[a]
    if split_dim(s) is None or split_dim(s) != split_dim(d) or min(parts(s), parts(d)) != 1 or s == d:
        return False
    other = 1 - a
    return split_dim(s) not in (split_dim(src.placements[other]), split_dim(dst.placements[other]))


def redistribute_steps(src, dst, sizes, n, e, grad: bool, exact: bool = False, synced: tuple = (),
                       shape: tuple | None = None, at: tuple = (0, 0)) -> tuple:
    """What `redistribution(src, dst)` moves: ([(axis, phase, bytes)], [step names]), for a rank
    holding n elements of e bytes before, on a mesh of `sizes` (R, C). Works on numbers (integer
    division, as the collective layer counts) and, with `exact`, on sympy symbols (the formulas
    `explain` prints). A gather over an axis in `synced` reduce-scatters the gradient back (a GradSync
    folded in: `passes.ops.comm.GatherSum`). With the tensor's global `shape` (numbers), each step is
    priced on the blocks it moves (`_blocks`): where a group does not divide a dim, the collective
    layer pads every member's torch.chunk block to the largest, and so does this."""
    steps = redistribution(src, dst)
    padded = shape is not None and not exact and len(src.placements) == 2 and len(dst.placements) == 2
    blocks = _blocks(src, dst, steps, sizes, shape) if padded and shape is not None else None
    div = (lambda a, b: a / b) if exact else (lambda a, b: a // b)
    size, moves, names = n, [], []  # size: elements this rank holds between steps
    for i, (kind, a, _, _, _) in enumerate(steps):
        g = sizes[a]
        size = blocks[i] if blocks else size
        if kind == "gather":
            moves.append((a, "fwd", all_gather_bytes(size * e, g)))
            size = size * g
            if a in synced:
                if grad:
                    moves.append((a, "bwd", reduce_scatter_bytes(size * e, g, exact)))
                names.append(f"all-gather(axis {a}; bwd reduce-scatter)")
                continue
            names.append(f"all-gather(axis {a})")
        elif kind == "reduce-scatter":  # padded: the input is padded to g of the largest output block
            moves.append((a, "fwd", reduce_scatter_bytes((blocks[i + 1] * g if blocks else size) * e, g, exact)))
            size = blocks[i + 1] if blocks else div(size, g)
            if grad:  # the gradient's block all-gathered back
                moves.append((a, "bwd", all_gather_bytes(size * e, g)))
            names.append(f"reduce-scatter(axis {a})")
        elif kind == "all-reduce":
            moves.append((a, "fwd", all_reduce_bytes(size * e, g, exact)))
            names.append(f"all-reduce(axis {a})")
        elif kind in ("regroup", "ungroup"):  # the same block size, other chunks: at the grid position `at`
            inverse = kind == "ungroup"
            moves.append((a, "fwd", regroup_bytes(size * e, g, steps[i][3], at[a], inverse, exact)))
            if grad:
                moves.append((a, "bwd", regroup_bytes(size * e, g, steps[i][3], at[a], not inverse, exact)))
            names.append(f"all-to-all(axis {a}; {'plain -> interleaved' if not inverse else 'interleaved -> plain'}"
                         f" blocks, bwd back)")
        elif kind == "split":
            size = blocks[i + 1] if blocks else div(size, g)
            if grad:
                moves.append((a, "bwd", all_gather_bytes(size * e, g)))
            names.append(f"split(axis {a}; bwd all-gather)")
        else:
            names.append(f"to-partial(axis {a})")
    return moves, names


def _blocks(src, dst, steps, sizes, shape: tuple) -> list:
    """Elements of the largest block (grid position (0, 0)'s torch.chunk block) of a tensor of global
    `shape` before each of `steps` and after the last: what every member sends or receives once the
    collective layer pads blocks to the largest."""
    cur = list(src.placements)
    out = [math.prod(local_shape(shape, src, sizes, at=(0, 0)))]
    for kind, a, _, _, _ in steps:
        cur[a] = Replicate() if kind in ("gather", "all-reduce") else dst[a]
        out.append(math.prod(local_shape(shape, Layout(tuple(cur)), sizes, at=(0, 0))))
    return out


def nodes_needing_grad(gm: torch.fx.GraphModule) -> set:
    """Nodes whose value depends on a trained floating-point parameter (or an input that needs a
    gradient): only their backward runs. A
    frozen parameter (requires_grad=False: peft's base layers) gets no gradient, so neither its weight
    gradient nor its gradient reduction is priced, and what only it feeds saves nothing for backward."""
    out = set()
    for node in gm.graph.nodes:
        v = node.meta.get("val")
        floating = isinstance(v, torch.Tensor) and v.dtype.is_floating_point or isinstance(v, (tuple, list))
        if node.op == "placeholder":  # a trained parameter; or an input that needs a gradient (a pipeline
            # stage's received hidden states, whose gradient is sent back)
            role = node.meta.get(ROLE)
            if floating and (role == "param" and getattr(v, "requires_grad", True)
                             or role == "input" and getattr(v, "requires_grad", False)):
                out.add(node)
        elif floating and any(a in out for a in node.all_input_nodes):
            out.add(node)
    return out


def node_cost(gm: torch.fx.GraphModule, node: Node, mesh, grads: set | None = None, at: tuple = (0, 0)) -> Cost | None:
    """The bytes an inserted module of the rewritten graph receives, from the spec the insertion pass
    recorded on it (`node.meta[KERNEL]`); None for an op that is not a module, `Cost("")` for
    a module without one. `grads`: nodes_needing_grad(gm), computed once per graph by the caller;
    `mesh`: (R, C) or q; `at`: the grid position priced (see `passes.kernels.spec.Site`)."""
    if node.op != "call_module":
        return None
    spec = node.meta.get(KERNEL)
    if spec is None:
        return Cost("")
    return spec.inserted_cost(node, mesh, grads if grads is not None else nodes_needing_grad(gm), at)


def node_calls(gm: torch.fx.GraphModule, node: Node, mesh, grads: set, at: tuple = (0, 0)) -> tuple:
    """(forward, backward) collective calls per rank of an inserted module of the rewritten graph, from
    its spec and (for a SUMMA product) the lowering its module runs; (0, 0) for any other node."""
    spec = node.meta.get(KERNEL) if node.op == "call_module" else None
    if spec is None:
        return 0, 0
    lowering = getattr(gm.get_submodule(node.target), "lowering", "broadcast")
    return spec.inserted_calls(node, mesh, grads, lowering=lowering, at=at)
