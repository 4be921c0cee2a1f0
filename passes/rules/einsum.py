"""`torch.einsum` of two or more operands, split on its subscripts.

Each mesh axis splits at most one subscript letter. Every operand holding that letter is split on
it over the axis, the others stay whole over it; the output is split on the letter when it keeps it,
and is a partial sum over the axis when the letter is summed out. Any such assignment computes the
einsum block by block with no communication in the op; the insertion pass brings the operands to it
and sums the gradient of an operand whole over a split axis.

The letter of an axis is the one an operand is already split on over it (so the einsum follows the
layouts it gets, as a matmul keeps its batch split), else an output letter of a weight not placed yet
(its first use then stores it split), else the first output letter the axis divides.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from passes.layout import REPLICATED, Layout, parts, split_dim
from passes.rules.registry import Strategy, Unsupported, register
from passes.nodes import shape

aten = torch.ops.aten


def parse(equation: str, ranks: list) -> tuple:
    """(operand subscripts, output subscripts) of an explicit or implicit equation for operands of
    `ranks` dims; an ellipsis becomes upper-case letters (right-aligned, as einsum broadcasts it).

    >>> parse("bind,jnd->bnij", [4, 3])
    (['bind', 'jnd'], 'bnij')
    >>> parse("ij,jk", [2, 2])
    (['ij', 'jk'], 'ik')
    >>> parse("...qd,...kd->...qk", [4, 4])
    (['ABqd', 'ABkd'], 'ABqk')
    """
    eq = equation.replace(" ", "")
    lhs, arrow, rhs = eq.partition("->")
    subs = lhs.split(",")
    if len(subs) != len(ranks):
        raise Unsupported(f"einsum equation {equation!r} for {len(ranks)} operands")
    if any(c.isupper() for c in eq):
        raise Unsupported("einsum with upper-case subscripts")
    widths = [n - len(sub.replace("...", "")) if "..." in sub else 0 for sub, n in zip(subs, ranks)]
    dots = "".join(chr(ord("A") + i) for i in range(max(widths, default=0)))
    subs = [sub.replace("...", dots[len(dots) - w:] if w else "") for sub, w in zip(subs, widths)]
    if not arrow:  # implicit output: the ellipsis, then the letters seen once in alphabetical order
        seen = "".join(subs)
        rhs = dots + "".join(sorted(c for c in set(seen) if seen.count(c) == 1 and c.islower()))
    else:
        rhs = rhs.replace("...", dots)
    return subs, rhs


def _axis_letter(axis: int, subs, ops, sizes: dict, layouts: dict, mesh, taken, out: str):
    """The letter mesh `axis` splits: one an operand is split on over it; else an output letter of a
    parameter not placed yet (so the weight is split, not kept whole); else the first output letter
    the axis divides."""
    free = [c for c in out if c not in taken and sizes[c] % mesh[axis] == 0]
    for sub, node in zip(subs, ops):
        lay = layouts.get(node)
        if lay is None:
            continue
        p = lay.normalized(len(sub))[axis]
        d = split_dim(p)
        if d is not None and parts(p) == 1 and sub[d] not in taken and sizes[sub[d]] % mesh[axis] == 0:
            return sub[d]
    unplaced = [c for sub, node in zip(subs, ops) if layouts.get(node, REPLICATED) is None for c in sub]
    return next((c for c in free if c in unplaced), free[0] if free else None)


@register(aten.einsum.default)
def einsum(node, layouts, mesh) -> Strategy:
    equation, ops = node.args[0], list(node.args[1])
    if not all(hasattr(o, "meta") for o in ops):
        raise Unsupported("einsum of a non-tensor operand")
    subs, out = parse(equation, [len(shape(o)) for o in ops])
    sizes: dict = {}
    for sub, o in zip(subs, ops):
        if len(set(sub)) != len(sub) or len(sub) != len(shape(o)):
            raise Unsupported(f"einsum subscripts {sub!r} (a repeated letter takes a diagonal)")
        for c, n in zip(sub, shape(o)):
            if sizes.setdefault(c, n) != n and n != 1 and sizes[c] != 1:
                raise Unsupported(f"einsum letter {c!r} of sizes {sizes[c]} and {n}")
            sizes[c] = max(sizes[c], n)
    if any(shape(o)[sub.index(c)] == 1 < sizes[c] for sub, o in zip(subs, ops) for c in sub):
        raise Unsupported("einsum with a broadcast (size-1) dim")
    letters: list = []
    for axis in (0, 1):
        letters.append(_axis_letter(axis, subs, ops, sizes, layouts, mesh, [c for c in letters if c], out)
                       if mesh[axis] > 1 else None)
    need = {}
    for sub, o in zip(subs, ops):
        need[o] = Layout(tuple(Shard(sub.index(c)) if c is not None and c in sub else Replicate() for c in letters))
    result = Layout(tuple(Replicate() if c is None else Shard(out.index(c)) if c in out else Partial("sum")
                          for c in letters))
    split = ", ".join(f"{'rows' if a == 0 else 'columns'} on {c!r}" for a, c in enumerate(letters) if c)
    return Strategy(need, result, note=f"local einsum: {split}" if split else "einsum whole")
