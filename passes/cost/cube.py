"""Bytes one rank receives for one linear x [M, K] . W [K, N] in a training step (forward, then the
backward of both operands), under 1D, 2D and 3D tensor parallelism on p devices, even blocks, element
size e. The 3D formula is what `passes.ops.cube` runs and counts; the 1D and 2D ones are what
`passes.cost.planned` writes for a linear alone (`docs/design.md` section 1), set side by side here for
the planner's comparison (docs/benchmarks.md, "1D, 2D and 3D per linear").

- 1D (Megatron, p devices, the weight's N split): the activation all-gathered forward and its
  gradient reduce-scattered backward, once per pair of linears; charged here per linear as one
  all-reduce of the [M, K] input's gradient: 2(p-1)MK/p.
- 2D (SUMMA on R x C): three products, each (C-1)MK/(RC) + (R-1)KN/(RC) (forward AB, backward ABT and
  ATB receive the same).
- 3D (the depth algorithm on q x q x q): forward (q-1)(MK + KN + MN)/q^3, backward (q-1)(2MK + 2KN + MN)/q^3.

>>> cube_linear_bytes(8, 8, 12, 2, 4)  # M, K, N, q, e: forward and backward
(128, 208)
"""

from __future__ import annotations

__all__ = ["cube_linear_bytes", "summa_linear_bytes", "megatron_linear_bytes", "matmul_lower_bound"]


def cube_linear_bytes(M: int, K: int, N: int, q: int, e: int) -> tuple:
    """(forward, backward) bytes received per rank by one 3D linear on a q x q x q cube."""
    return e * (q - 1) * (M * K + K * N + M * N) // q ** 3, e * (q - 1) * (2 * M * K + 2 * K * N + M * N) // q ** 3


def summa_linear_bytes(M: int, K: int, N: int, R: int, C: int, e: int) -> tuple:
    """(forward, backward) bytes received per rank by one SUMMA linear on an R x C grid."""
    one = e * ((C - 1) * M * K + (R - 1) * K * N) // (R * C)
    return one, 2 * one


def megatron_linear_bytes(M: int, K: int, N: int, p: int, e: int) -> tuple:
    """(forward, backward) bytes per rank of one 1D linear, charged as one all-reduce of its input's
    gradient (a column-parallel and a row-parallel linear share a forward and a backward all-reduce
    of [M, K] or [M, N]; half of each is charged to each)."""
    return e * (p - 1) * M * K // p, e * (p - 1) * M * K // p


def matmul_lower_bound(M: int, K: int, N: int, p: int) -> float:
    """Elements a rank must send or receive in one product of M x K by K x N on p ranks that start
    with 1/p of each operand and end with 1/p of the result, computing 1/p of the MKN products
    (Loomis-Whitney: the products it computes touch at least 3(MKN/p)^(2/3) elements of the three
    matrices, of which it holds (MK + KN + MN)/p); 0 where that is negative."""
    return max(0.0, 3 * (M * K * N / p) ** (2 / 3) - (M * K + K * N + M * N) / p)
