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
