"""Planned communication of the inserted modules: bytes received per rank, forward and backward, as
sympy expressions in the grid shape R x C, the element size e and the sizes the module moves. A
collective over mesh axis 0 has R members, one over axis 1 has C (written g below).

Uses the conventions of `passes.mesh.CommLog` (broadcast: N on each non-root; reduce: (g-1)N on the
destination; all-gather: (g-1)N; reduce-scatter: floor((g-1)N/g); all-reduce: floor(2(g-1)N/g)), so
for a training step the numbers equal what the collective layer counts at run time -- a test runs a
real step and compares. Requires `autopar_layout` and `val` on the inserted nodes and their inputs.

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

from passes.layout import local_shape, mesh_shape, parts, split_dim
from passes.ops import kernels

R, C, E = sympy.symbols("R C e", positive=True, integer=True)
AXIS_SIZE = (R, C)  # members of a collective over mesh axis 0 / 1


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


def _all_reduce(n, g):
    return sympy.floor(2 * (g - 1) * n / g)


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


def redistribute_steps(src, dst, sizes, n, e, grad: bool, exact: bool = False) -> tuple:
    """What `kernels.Redistribute(src -> dst)` moves: ([(axis, phase, bytes)], [step names]), for a
    rank holding n elements of e bytes before, on a mesh of `sizes` (R, C). Works on numbers (integer
    division, as the collective layer counts) and, with `exact`, on sympy symbols (the formulas
    `explain` prints)."""
    div = (lambda a, b: a / b) if exact else (lambda a, b: a // b)
    floor = (lambda a, b: sympy.floor(a / b)) if exact else (lambda a, b: a // b)
    cur, size, moves, names = list(src.placements), n, [], []
    for a in range(2):
        if split_dim(cur[a]) is not None and cur[a] != dst[a]:
            moves.append((a, "fwd", (sizes[a] - 1) * size * e))
            size = size * sizes[a]
            cur[a] = Replicate()
            names.append(f"all-gather(axis {a})")
    for a in range(2):
        s, d, g = cur[a], dst[a], sizes[a]
        if s == d:
            continue
        if isinstance(s, Partial) and isinstance(d, Shard) and parts(d) == 1:
            moves.append((a, "fwd", floor((g - 1) * size * e, g)))
            size = div(size, g)
            if grad:
                moves.append((a, "bwd", (g - 1) * size * e))
            names.append(f"reduce-scatter(axis {a})")
            continue
        if isinstance(s, Partial):
            moves.append((a, "fwd", floor(2 * (g - 1) * size * e, g)))
            names.append(f"all-reduce(axis {a})")
        if split_dim(d) is not None:
            size = div(size, g)
            if grad:
                moves.append((a, "bwd", (g - 1) * size * e))
            names.append(f"split(axis {a}; bwd all-gather)")
        elif isinstance(d, Partial):
            names.append(f"to-partial(axis {a})")
    return moves, names


def _local(node: Node, mesh) -> tuple:
    v = node.meta["val"]
    return local_shape(tuple(v.shape), node.meta["autopar_layout"], mesh, node.name)


def _sizes(mesh) -> dict:
    return {R: mesh[0], C: mesh[1]}


def nodes_needing_grad(gm: torch.fx.GraphModule) -> set:
    """Nodes whose value depends on a floating-point parameter: only their backward runs."""
    out = set()
    for node in gm.graph.nodes:
        v = node.meta.get("val")
        floating = isinstance(v, torch.Tensor) and v.dtype.is_floating_point or isinstance(v, (tuple, list))
        if node.op == "placeholder":
            if node.meta.get("autopar_role") == "param" and floating:
                out.add(node)
        elif floating and any(a in out for a in node.all_input_nodes):
            out.add(node)
    return out


def redistribute_cost(mod: kernels.Redistribute, node: Node, mesh, grads: set) -> Cost:
    v = node.args[0].meta["val"]
    n = sympy.Symbol("n", positive=True)  # elements this rank holds before
    moves, steps = redistribute_steps(mod.src, mod.dst, AXIS_SIZE, n, E, node.args[0] in grads, exact=True)
    fwd = sum((b for _, phase, b in moves if phase == "fwd"), sympy.Integer(0))
    bwd = sum((b for _, phase, b in moves if phase == "bwd"), sympy.Integer(0))
    values = {**_sizes(mesh), E: v.element_size(), n: math.prod(local_shape(tuple(v.shape), mod.src, mesh))}
    return Cost(", ".join(steps), fwd, bwd, values)


def summa_cost(mod: kernels.SummaLinear, node: Node, mesh, grads: set) -> Cost:
    x, w = node.args[0], node.args[1]
    M_, K_ = math.prod(x.meta["val"].shape[:-1]), x.meta["val"].shape[-1]
    N_ = node.meta["val"].shape[-1]
    M, K, N = sympy.symbols("M K N", positive=True)
    values = {**_sizes(mesh), E: node.meta["val"].element_size(), M: M_, K: K_, N: N_}
    n_grads = int(x in grads) + int(w in grads)
    if mod.transposed:
        f, b = summa_abt_bytes(M, K, N, n_grads)
        return Cost("SUMMA ABT: bcast W (col), reduce Y (row); bwd AB + ATB", f, b, values)
    f, b = summa_ab_bytes(M, K, N, n_grads)
    return Cost("SUMMA AB: bcast X (row), W (col); bwd ABT + ATB", f, b, values)


def norm_cost(mod: kernels.ShardedNorm, node: Node, mesh, grads: set) -> Cost:
    t = sympy.Symbol("t", positive=True)  # tokens this rank normalizes
    size = kernels.norm_stat_size(node.args[0].meta["val"].dtype)
    fwd_calls, bwd_calls = kernels.NORM_STATS[mod.centered]
    fwd = sum((_all_reduce(k * size * t, C) for k in fwd_calls), sympy.Integer(0))
    bwd = sum((_all_reduce(k * size * t, C) for k in bwd_calls), sympy.Integer(0))
    return Cost(f"all-reduce x{len(fwd_calls)} (row) stats; bwd x{len(bwd_calls)}", fwd,
                bwd if node.args[0] in grads else sympy.Integer(0), {C: mesh[1], t: math.prod(_local(node, mesh)[:-1])})


def gradsync_cost(mod: kernels.GradSync, node: Node, mesh, grads: set) -> Cost:
    n = sympy.Symbol("n", positive=True)
    expr = sum((_all_reduce(n * E, AXIS_SIZE[a]) for a in mod.axes), sympy.Integer(0)) \
        if node.args[0] in grads else sympy.Integer(0)
    return Cost(f"bwd all-reduce over axes {mod.axes}", sympy.Integer(0), expr,
                {**_sizes(mesh), E: node.meta["val"].element_size(), n: math.prod(_local(node, mesh))})


def cross_entropy_cost(mod, node: Node, mesh, grads: set) -> Cost:
    r = sympy.Symbol("r", positive=True)  # rows of logits on this rank
    if not mod.vocab_split:
        return Cost("all-reduce mean (col)", _all_reduce(8, R), sympy.Integer(0), {R: mesh[0]})
    expr = _all_reduce(4 * r, C) + _all_reduce(8 * r, C) + _all_reduce(8, R)
    return Cost("all-reduce max, sum-exp, target (row); mean (col)", expr, sympy.Integer(0),
                {**_sizes(mesh), r: _local(node.args[0], mesh)[0]})


def node_flops(gm, node, mesh) -> int:
    """Forward + backward FLOPs of one matmul-like node on one rank."""
    mesh = mesh_shape(mesh)
    if node.op == "call_module" and isinstance(gm.get_submodule(node.target), kernels.SummaLinear):
        x, w = node.args[0], node.args[1]
        m = math.prod(x.meta["val"].shape[:-1]) // mesh[0]  # this rank's rows
        k, n = x.meta["val"].shape[-1], math.prod(w.meta["val"].shape) // x.meta["val"].shape[-1]
        return 3 * 2 * m * k * n // mesh[1]  # (m, k) x (k, n/C) in pieces
    if node.op == "call_function" and node.target == torch.ops.aten.scaled_dot_product_attention.default:
        qs = local_shape(tuple(node.args[0].meta["val"].shape), node.meta["autopar_layout"], mesh)
        b, h, s, d = qs
        sk = node.args[1].meta["val"].shape[-2]
        return 3 * 2 * 2 * b * h * s * sk * d
    if node.op == "call_function" and node.target in (torch.ops.aten.matmul.default, torch.ops.aten.bmm.default):
        out = local_shape(tuple(node.meta["val"].shape), node.meta["autopar_layout"], mesh)
        k = node.args[0].meta["val"].shape[-1]
        return 3 * 2 * math.prod(out) * k
    return 0



COSTS = {
    kernels.Redistribute: redistribute_cost,
    kernels.SummaLinear: summa_cost,
    kernels.ShardedNorm: norm_cost,
    kernels.GradSync: gradsync_cost,
    kernels.VocabParallelCrossEntropy: cross_entropy_cost,
}


def node_cost(gm: torch.fx.GraphModule, node: Node, mesh, grads: set | None = None) -> Cost | None:
    """`grads`: nodes_needing_grad(gm), computed once per graph by the caller; `mesh`: (R, C) or q."""
    mesh = mesh_shape(mesh)
    if node.op != "call_module":
        return None
    mod = gm.get_submodule(node.target)
    fn = COSTS.get(type(mod))
    return fn(mod, node, mesh, grads if grads is not None else nodes_needing_grad(gm)) if fn else Cost("")
