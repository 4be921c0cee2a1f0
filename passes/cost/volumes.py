"""The bytes one rank receives in each collective, written once: the counters of `passes.ops` log these
at run time and the planner prices them, so the two agree by construction (the conventions of
`passes.mesh.CommLog`). `n` is bytes, `g` the members of the group.

A count is a whole number of bytes: where g does not divide the volume it is floored, as the counters
log it; with `exact` the same floor as a sympy expression (the formulas `explain` prints).
`all_reduce_mean_bytes` is the one unfloored form, for analytic models that compare rates, not counts.

>>> all_reduce_bytes(1000, 3), reduce_scatter_bytes(1000, 3), all_gather_bytes(1000, 3)
(1333, 666, 2000)
>>> import sympy
>>> all_reduce_bytes(sympy.Symbol("n", positive=True), 4, exact=True)
floor(3*n/2)
"""

from __future__ import annotations

from collections.abc import Sequence

import sympy


def _floor_div(total, g, exact: bool):
    return sympy.floor(total / g) if exact else total // g


def broadcast_bytes(n):
    """A broadcast of n bytes: n on each non-root; the root receives nothing."""
    return n


def reduce_bytes(n, g):
    """A reduce of n bytes: (g-1)n on the destination; the others receive nothing."""
    return (g - 1) * n


def all_gather_bytes(n, g):
    """An all-gather of n bytes per member: (g-1)n, every other member's block."""
    return (g - 1) * n


def reduce_scatter_bytes(n, g, exact: bool = False):
    """A reduce-scatter of an n-byte input: floor((g-1)n/g), the others' share of this member's block."""
    return _floor_div((g - 1) * n, g, exact)


def all_reduce_bytes(n, g, exact: bool = False):
    """A ring all-reduce of n bytes (a reduce-scatter, then an all-gather): floor(2(g-1)n/g)."""
    return _floor_div(2 * (g - 1) * n, g, exact)


def all_reduce_mean_bytes(n, g) -> float:
    """`all_reduce_bytes` unfloored, 2(g-1)n/g: what a calibration fit uses, a rate per byte rather
    than a count."""
    return 2 * (g - 1) * n / g


def all_to_all_bytes(recv: Sequence[int], me: int, row: int) -> int:
    """An all-to-all in which member `me` receives recv[j] rows of `row` bytes from member j: every row
    but its own."""
    return row * (sum(recv) - recv[me])


def regroup_chunks(g: int, k: int, me: int, inverse: bool = False) -> tuple:
    """A dim of k g equal chunks moved between plain blocks (member j holds chunks j k ... j k + k - 1) and
    interleaved ones (member j holds chunks j, j + g, ..., j + (k - 1) g: block j of each of k parts,
    a fused projection's layout): (chunks member `me` sends to each member, chunks it receives from
    each), in member order; `inverse` moves interleaved blocks back to plain ones. A member sends its
    chunks in the order of (destination, chunk) and receives them in the order of (source, chunk).

    >>> regroup_chunks(4, 3, 0)  # member 0 of 4 holds chunks 0, 1, 2 and needs 0, 4, 8
    ([1, 1, 1, 0], [1, 1, 1, 0])
    """
    plain = [me * k + r for r in range(k)]  # the chunks `me` holds as plain blocks
    mixed = [p * g + me for p in range(k)]  # and as interleaved ones
    to_plain = [sum(1 for c in mixed if c // k == j) for j in range(g)]
    to_mixed = [sum(1 for c in plain if c % g == j) for j in range(g)]
    return (to_plain, to_mixed) if inverse else (to_mixed, to_plain)


def regroup_bytes(n, g: int, k: int, me: int, inverse: bool = False, exact: bool = False):
    """What member `me` receives regrouping (`regroup_chunks`) its n-byte block: the chunks other
    members hold, n/k bytes each."""
    recv = regroup_chunks(g, k, me, inverse)[1]
    return _floor_div(n * (sum(recv) - recv[me]), k, exact)
