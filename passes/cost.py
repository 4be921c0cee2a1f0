"""Planned communication of the inserted modules: bytes received per rank, forward and backward.

Uses the conventions of `passes.mesh.CommLog`, so for a training step the plan equals what the
collective layer counts at run time. Requires `autopar_layout` and `val` on the inserted nodes and on
their inputs; writes nothing, returns `Cost` records.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.fx import Node

from passes.layout import local_shape, parts, split_dim
from passes.ops import kernels


@dataclass
class Cost:
    collectives: str
    fwd: int
    bwd: int


def _local(node: Node, q: int) -> tuple:
    v = node.meta["val"]
    return local_shape(tuple(v.shape), node.meta["autopar_layout"], q, node.name)


def _bytes(node: Node, q: int) -> int:
    return math.prod(_local(node, q)) * node.meta["val"].element_size()


def _all_reduce(n: int, q: int) -> int:
    return 2 * (q - 1) * n // q


def redistribute_cost(mod: kernels.Redistribute, node: Node, q: int) -> Cost:
    v = node.args[0].meta["val"]
    elt = v.element_size()
    cur = list(mod.src.placements)
    shape = list(local_shape(tuple(v.shape), mod.src, q))
    fwd = bwd = 0
    steps = []
    for a in range(2):
        if split_dim(cur[a]) is not None and cur[a] != mod.dst[a]:
            fwd += (q - 1) * math.prod(shape) * elt
            shape[cur[a].dim] *= q
            cur[a] = Replicate()
            steps.append(f"all-gather(axis {a})")
    for a in range(2):
        s, d = cur[a], mod.dst[a]
        if s == d:
            continue
        n = math.prod(shape) * elt
        if isinstance(s, Partial) and isinstance(d, Shard) and parts(d) == 1:
            fwd += (q - 1) * n // q
            shape[d.dim] //= q
            bwd += (q - 1) * math.prod(shape) * elt
            steps.append(f"reduce-scatter(axis {a})")
            continue
        if isinstance(s, Partial):
            fwd += _all_reduce(n, q)
            steps.append(f"all-reduce(axis {a})")
        if split_dim(d) is not None:
            shape[d.dim] //= q
            bwd += (q - 1) * math.prod(shape) * elt if v.dtype.is_floating_point else 0
            steps.append(f"split(axis {a}; bwd all-gather)")
        elif isinstance(d, Partial):
            steps.append(f"to-partial(axis {a})")
    return Cost(", ".join(steps), fwd, bwd)


def summa_cost(mod: kernels.SummaLinear, node: Node, q: int) -> Cost:
    x, w = node.args[0], node.args[1]
    elt = node.meta["val"].element_size()
    X = math.prod(_local(x, q)) * elt
    W = math.prod(_local(w, q)) * elt
    Y = math.prod(_local(node, q)) * elt
    k = q - 1
    if mod.transposed:  # ABT fwd; bwd AB(dY, W) + ATB(dY, X)
        return Cost("SUMMA ABT: bcast W (col), reduce Y (row); bwd AB + ATB", k * (W + Y), 2 * k * (Y + W))
    return Cost("SUMMA AB: bcast X (row), W (col); bwd ABT + ATB", k * (X + W), 2 * k * (X + W))


def norm_cost(mod: kernels.ShardedNorm, node: Node, q: int) -> Cost:
    rows = math.prod(_local(node, q)[:-1]) * 4  # fp32 statistics, one per token
    n = (2 if mod.centered else 1) * _all_reduce(rows, q)
    return Cost(f"all-reduce x{2 if mod.centered else 1} (row) stats", n, n)


def gradsync_cost(mod: kernels.GradSync, node: Node, q: int) -> Cost:
    return Cost(f"bwd all-reduce over axes {mod.axes}", 0, len(mod.axes) * _all_reduce(_bytes(node, q), q))


def cross_entropy_cost(mod, node: Node, q: int) -> Cost:
    rows = _local(node.args[0], q)[0]
    if not mod.vocab_split:
        return Cost("all-reduce mean (col)", _all_reduce(2 * 4, q), 0)
    fwd = _all_reduce(rows * 4, q) + _all_reduce(2 * rows * 4, q) + _all_reduce(2 * 4, q)
    return Cost("all-reduce max, sum-exp, target (row); mean (col)", fwd, 0)


COSTS = {
    kernels.Redistribute: redistribute_cost,
    kernels.SummaLinear: summa_cost,
    kernels.ShardedNorm: norm_cost,
    kernels.GradSync: gradsync_cost,
    kernels.VocabParallelCrossEntropy: cross_entropy_cost,
}


def node_cost(gm: torch.fx.GraphModule, node: Node, q: int) -> Cost | None:
    if node.op != "call_module":
        return None
    mod = gm.get_submodule(node.target)
    fn = COSTS.get(type(mod))
    return fn(mod, node, q) if fn else Cost("", 0, 0)
