"""Planned communication of the inserted modules: bytes received per rank, forward and backward, as
sympy expressions in the grid size q, the element size e and the sizes the module moves.

Uses the conventions of `passes.mesh.CommLog` (broadcast: N on each non-root; reduce: (q-1)N on the
destination; all-gather: (q-1)N; reduce-scatter: floor((q-1)N/q); all-reduce: floor(2(q-1)N/q)), so
for a training step the numbers equal what the collective layer counts at run time -- a test runs a
real step and compares. Requires `autopar_layout` and `val` on the inserted nodes and their inputs.

>>> import sympy
>>> M, K, N = sympy.symbols("M K N", positive=True)
>>> summa_ab_bytes(M, K, N)[0]
e*(q - 1)*(K*M + K*N)/q**2
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import sympy
import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.fx import Node

from passes.layout import local_shape, parts, split_dim
from passes.ops import kernels

Q, E = sympy.symbols("q e", positive=True, integer=True)


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


def _all_reduce(n):
    return sympy.floor(2 * (Q - 1) * n / Q)


def summa_ab_bytes(M, K, N, grads=2):
    """AB forward, then ABT (for dX) and ATB (for dW) backward: (q-1)/q^2 (MK + KN) e each; `grads`
    says how many of the two backward products run (an input without gradient skips ABT)."""
    one = E * (Q - 1) * (M * K + K * N) / Q**2
    return one, grads * one


def summa_abt_bytes(M, K, N, grads=2):
    """ABT forward (broadcast W, reduce Y), then AB + ATB backward: (q-1)/q^2 (KN + MN) e each."""
    one = E * (Q - 1) * (K * N + M * N) / Q**2
    return one, grads * one


def _local(node: Node, q: int) -> tuple:
    v = node.meta["val"]
    return local_shape(tuple(v.shape), node.meta["autopar_layout"], q, node.name)


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


def redistribute_cost(mod: kernels.Redistribute, node: Node, q: int, grads: set) -> Cost:
    v = node.args[0].meta["val"]
    n = sympy.Symbol("n", positive=True)  # elements this rank holds before
    cur = list(mod.src.placements)
    size = n  # elements held now, as a multiple of n
    fwd, bwd, steps = sympy.Integer(0), sympy.Integer(0), []
    for a in range(2):
        if split_dim(cur[a]) is not None and cur[a] != mod.dst[a]:
            fwd += (Q - 1) * size * E
            size = size * Q
            cur[a] = Replicate()
            steps.append(f"all-gather(axis {a})")
    for a in range(2):
        s, d = cur[a], mod.dst[a]
        if s == d:
            continue
        if isinstance(s, Partial) and isinstance(d, Shard) and parts(d) == 1:
            fwd += sympy.floor((Q - 1) * size * E / Q)
            size = size / Q
            if node.args[0] in grads:
                bwd += (Q - 1) * size * E
            steps.append(f"reduce-scatter(axis {a})")
            continue
        if isinstance(s, Partial):
            fwd += _all_reduce(size * E)
            steps.append(f"all-reduce(axis {a})")
        if split_dim(d) is not None:
            size = size / Q
            if node.args[0] in grads:
                bwd += (Q - 1) * size * E
            steps.append(f"split(axis {a}; bwd all-gather)")
        elif isinstance(d, Partial):
            steps.append(f"to-partial(axis {a})")
    values = {Q: q, E: v.element_size(), n: math.prod(local_shape(tuple(v.shape), mod.src, q))}
    return Cost(", ".join(steps), fwd, bwd, values)


def summa_cost(mod: kernels.SummaLinear, node: Node, q: int, grads: set) -> Cost:
    x, w = node.args[0], node.args[1]
    M_, K_ = math.prod(x.meta["val"].shape[:-1]), x.meta["val"].shape[-1]
    N_ = node.meta["val"].shape[-1]
    M, K, N = sympy.symbols("M K N", positive=True)
    values = {Q: q, E: node.meta["val"].element_size(), M: M_, K: K_, N: N_}
    n_grads = int(x in grads) + int(w in grads)
    if mod.transposed:
        f, b = summa_abt_bytes(M, K, N, n_grads)
        return Cost("SUMMA ABT: bcast W (col), reduce Y (row); bwd AB + ATB", f, b, values)
    f, b = summa_ab_bytes(M, K, N, n_grads)
    return Cost("SUMMA AB: bcast X (row), W (col); bwd ABT + ATB", f, b, values)


def norm_cost(mod: kernels.ShardedNorm, node: Node, q: int, grads: set) -> Cost:
    t = sympy.Symbol("t", positive=True)  # tokens this rank normalizes; one fp32 statistic each
    k = 2 if mod.centered else 1
    expr = k * _all_reduce(4 * t)
    return Cost(f"all-reduce x{k} (row) stats", expr, expr if node.args[0] in grads else sympy.Integer(0),
                {Q: q, t: math.prod(_local(node, q)[:-1])})


def gradsync_cost(mod: kernels.GradSync, node: Node, q: int, grads: set) -> Cost:
    n = sympy.Symbol("n", positive=True)
    expr = len(mod.axes) * _all_reduce(n * E) if node.args[0] in grads else sympy.Integer(0)
    return Cost(f"bwd all-reduce over axes {mod.axes}", sympy.Integer(0), expr,
                {Q: q, E: node.meta["val"].element_size(), n: math.prod(_local(node, q))})


def cross_entropy_cost(mod, node: Node, q: int, grads: set) -> Cost:
    r = sympy.Symbol("r", positive=True)  # rows of logits on this rank
    if not mod.vocab_split:
        return Cost("all-reduce mean (col)", _all_reduce(8), sympy.Integer(0), {Q: q})
    expr = _all_reduce(4 * r) + _all_reduce(8 * r) + _all_reduce(8)
    return Cost("all-reduce max, sum-exp, target (row); mean (col)", expr, sympy.Integer(0),
                {Q: q, r: _local(node.args[0], q)[0]})


def node_flops(gm, node, q: int) -> int:
    """Forward + backward FLOPs of one matmul-like node on one rank."""
    if node.op == "call_module" and isinstance(gm.get_submodule(node.target), kernels.SummaLinear):
        x, w = node.args[0], node.args[1]
        m = math.prod(x.meta["val"].shape[:-1]) // q  # this rank's rows
        k, n = x.meta["val"].shape[-1], math.prod(w.meta["val"].shape) // x.meta["val"].shape[-1]
        return 3 * 2 * m * k * n // q  # q steps of (m, k/q) x (k/q, n/q)
    if node.op == "call_function" and node.target == torch.ops.aten.scaled_dot_product_attention.default:
        qs = local_shape(tuple(node.args[0].meta["val"].shape), node.meta["autopar_layout"], q)
        b, h, s, d = qs
        sk = node.args[1].meta["val"].shape[-2]
        return 3 * 2 * 2 * b * h * s * sk * d
    if node.op == "call_function" and node.target in (torch.ops.aten.matmul.default, torch.ops.aten.bmm.default):
        out = local_shape(tuple(node.meta["val"].shape), node.meta["autopar_layout"], q)
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


def node_cost(gm: torch.fx.GraphModule, node: Node, q: int, grads: set | None = None) -> Cost | None:
    """`grads`: nodes_needing_grad(gm), computed once per graph by the caller."""
    if node.op != "call_module":
        return None
    mod = gm.get_submodule(node.target)
    fn = COSTS.get(type(mod))
    return fn(mod, node, q, grads if grads is not None else nodes_needing_grad(gm)) if fn else Cost("")
