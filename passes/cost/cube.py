"""Bytes one rank receives for one linear x [M, K] . W [K, N] in a training step (forward, then the
backward of both operands), under 2D and 3D tensor parallelism on p devices, even blocks, element size
e, and for a whole step of Megatron-style 1D tensor parallelism, the baseline the planner's 2D and 3D
are compared with (`autopar.compare_1d`, docs/benchmarks.md "1D, 2D and 3D per linear", the
generation benchmark's projection). The 3D formula is what `passes.ops.cube` runs and counts; the 2D
one is what `passes.cost.planned` writes for a linear alone (`docs/design.md` section 1).

- 1D (Megatron, p devices): each transformer layer's attention and MLP (a column-parallel linear,
  then a row-parallel one) all-reduce the [tokens, hidden] activations once forward and once
  backward (with sequence parallelism an all-gather and a reduce-scatter: the same bytes), and the
  vocabulary-parallel embedding once more forward: 2L + 1 ring all-reduces forward, 2L backward.
- 2D (SUMMA on R x C): three products, each (C-1)MK/(RC) + (R-1)KN/(RC) (forward AB, backward ABT and
  ATB receive the same).
- 3D (the depth algorithm on q x q x q): forward (q-1)(MK + KN + MN)/q^3, backward (q-1)(2MK + 2KN + MN)/q^3.

>>> cube_linear_bytes(8, 8, 12, 2, 4)  # M, K, N, q, e: forward and backward
(128, 208)
>>> megatron_bytes(32, 32, 3, 4, 4)  # tokens, hidden, layers, p, e: 7 and 6 all-reduces of 4096 bytes
(43008, 36864)
"""

from __future__ import annotations

from passes.cost.volumes import all_reduce_bytes

__all__ = ["cube_linear_bytes", "summa_linear_bytes", "megatron_bytes", "matmul_lower_bound"]


def cube_linear_bytes(M: int, K: int, N: int, q: int, e: int) -> tuple:
    """(forward, backward) bytes received per rank by one 3D linear on a q x q x q cube."""
    return e * (q - 1) * (M * K + K * N + M * N) // q ** 3, e * (q - 1) * (2 * M * K + 2 * K * N + M * N) // q ** 3


def summa_linear_bytes(M: int, K: int, N: int, R: int, C: int, e: int) -> tuple:
    """(forward, backward) bytes received per rank by one SUMMA linear on an R x C grid."""
    one = e * ((C - 1) * M * K + (R - 1) * K * N) // (R * C)
    return one, 2 * one


def megatron_bytes(tokens: int, hidden: int, layers: float, p: int, e: int) -> tuple:
    """(forward, backward) bytes received per rank by a step of Megatron-style 1D tensor parallelism on
    p devices over `tokens` tokens: 2 `layers` + 1 ring all-reduces of the [tokens, hidden] activations
    forward (two per layer, one for the vocabulary-parallel embedding), 2 `layers` backward, each
    counted as the collective layer counts one (`all_reduce_bytes`). Norms and the loss are not
    counted, nor an untied vocabulary-parallel LM head's backward all-reduce of its input's gradient,
    which the engine's own strategy='1d' moves and counts (`autopar.plan(grid=(1, p), strategy='1d')`).
    `layers` may be fractional (a model without repeated blocks: its weight matrices over 4)."""
    one = all_reduce_bytes(tokens * hidden * e, p)  # one ring all-reduce of [tokens, hidden]
    return (2 * layers + 1) * one, 2 * layers * one


def matmul_lower_bound(M: int, K: int, N: int, p: int) -> float:
    """Elements a rank must send or receive in one product of M x K by K x N on p ranks that start
    with 1/p of each operand and end with 1/p of the result, computing 1/p of the MKN products
    (Loomis-Whitney: the products it computes touch at least 3(MKN/p)^(2/3) elements of the three
    matrices, of which it holds (MK + KN + MN)/p); 0 where that is negative."""
    return max(0.0, 3 * (M * K * N / p) ** (2 / 3) - (M * K + K * N + M * N) / p)
