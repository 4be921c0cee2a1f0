"""Experts as a batched matmul over a 3-D weight (Llama 4's `Llama4TextExperts`).

Llama 4 runs every expert on every token, the tokens it did not pick scaled to zero: the routed
tokens x [E*T, H] are viewed [E, T, H] and go through `bmm(x, gate_up [E, H, 2I])`, `up * act(gate)`,
`bmm(., down [E, I, H])`, then a sum over the experts. Unlike transformers' grouped experts
(`passes.rules.moe.experts`) no routing picks rows: the expert dim is a batch dim of both operands. The
layouts, for an R x C grid, the same split of the weights as the grouped experts':

    x  [E, T, H]  S(0)R                                 (each row's experts' tokens, whole over the columns)
    w1 [E, H, 2I] S(0)S(2)x2   -> h [E, T, 2I] S(0)S(2)x2   interleaved: gate and up blocks match per column
    act(gate) * up             -> g [E, T, I]  S(0)S(2)
    w2 [E, I, H]  S(0)S(1)     -> y [E, T, H]  S(0)P(sum)   this column's share of I
    sum over the experts       -> [T, H]       P(sum)P(sum)

A rank holds 1/(RC) of each expert weight. An expert count R does not divide is split in torch.chunk
blocks (indivisible='uneven': both operands' expert dims are cut the same way), else the experts stay
whole over the rows and `explain` says so.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

import operator

from passes.layout import REPLICATED, Layout, Strided, split_dim, uneven_ok
from passes.rules.registry import Strategy
from passes.nodes import shape, tensor_inputs
from passes.rules.moe.expert_rows import ZERO_KEEPING
from passes.rules.weights import fused_parts, is_param, whole_experts_why

aten = torch.ops.aten
_BETWEEN = ZERO_KEEPING | {aten.chunk, aten.split, aten.split_with_sizes}  # act(gate) * up and its cut


def applies(node) -> bool:
    """bmm(x [E, T, K], w [E, K, N]) with w a 3-D parameter (or a transpose of one), unplaced or as an
    earlier compile placed it (experts over the rows or whole)."""
    if node.target != aten.bmm.default:
        return False
    w = node.args[1]
    return len(shape(w)) == 3 and is_param(w) and len(shape(node.args[0])) == 3


def _second(node) -> bool:
    """x is, through the cut into gate and up, the activation and their product, the output of another
    batched-experts matmul over as many experts: `node` is the down projection."""
    x = node.args[0]
    while x.op == "call_function" and not applies(x):
        packet = getattr(x.target, "overloadpacket", None)
        ins = tensor_inputs(x)
        if (x.target is not operator.getitem and packet not in _BETWEEN) or not ins:
            return False
        x = ins[0]
    return x.op == "call_function" and shape(x.args[1])[0] == shape(node.args[1])[0]


def _columns(node, x_col, k_size: int, n_size: int, C: int, uneven: bool) -> tuple:
    """(x's, w's and the output's placement over the columns): the second matmul of a pair reads its
    input split on K (the intermediate dim, as the first left it) and sums over the columns; the first
    reads x whole and splits N, interleaved when its output is cut into equal parts (gate|up), so that
    the activation between them runs on its blocks."""
    second = _second(node)
    if C > 1 and second and split_dim(x_col) == 2 and not isinstance(x_col, Strided) and (k_size % C == 0 or uneven):
        return Shard(2), Shard(1), Partial("sum")
    parts = fused_parts(node)
    if C > 1 and n_size % (C * parts) == 0:
        return (Replicate(), Strided(2, split_factor=parts), Strided(2, split_factor=parts)) if parts > 1 else \
            (Replicate(), Shard(2), Shard(2))
    if C > 1 and parts == 1 and uneven:
        return Replicate(), Shard(2), Shard(2)
    return Replicate(), Replicate(), Replicate()


def batched_experts(node, layouts, mesh) -> Strategy:
    x, w = node.args[:2]
    E, K, N = shape(w)
    R, C = mesh[0], mesh[1]
    have = (layouts.get(x) or REPLICATED).normalized(3)
    placed = layouts.get(w)
    split = R > 1 and (E % R == 0 or uneven_ok(mesh))
    if placed is not None:  # pinned by an earlier compile (another input shape): keep its expert blocks
        split = placed.normalized(3)[0] == Shard(0)
    x1, w1, o1 = _columns(node, have[1], K, N, C, uneven_ok(mesh))
    row = Shard(0) if split else Replicate()
    strat = Strategy({x: Layout((row, x1)), w: Layout((row, w1))}, Layout((row, o1)),
                     note="experts over the rows" if split else "")
    if split or R == 1:
        return strat
    strat.fallback = True  # correct, but each rank stores R times its share of the experts -- say so
    strat.note = whole_experts_why(w, E, R, placed)
    return strat
