"""What one rank receives in the SUMMA products of a linear whose dims the grid does not divide.

With even blocks every rank receives the same, and `passes.cost.planned.summa_axis_elems` gives it. With
torch.chunk blocks (a vocabulary of 97, a hidden size of 27) the blocks differ per rank, and so does
what each receives: a broadcast step sends the owner's piece to the members that do not hold it, a
reduce sums a piece onto the member that keeps it, and the all-gather lowering pads every block to
the largest (`passes.ops.comm.all_gather`). This module counts those exactly for the rank at grid
position (r, c), in elements, per mesh axis, as `passes.ops.summa` runs them.

A product is named by its kind and its roles (see `passes.ops.summa`): a [m, K] times b, with the
contracted dim K over the columns in a, and N the other dim of b (over the columns in the output of
AB and ABT, over the rows in b of ABT).

>>> product_elems("abt", "broadcast", (2, 2), (0, 1), m=16, K=24, N=97)  # b [49 | 48, 12], out [16, 48]
[(0, 576), (1, 768)]
"""

from __future__ import annotations

from passes.layout import chunk_range

__all__ = ["product_elems", "step_products"]


def _size(n: int, q: int, i: int) -> int:
    lo, hi = chunk_range(n, q, i)
    return hi - lo


def _shared(n: int, R: int, r: int, C: int, c: int) -> int:
    """Elements of `n` in both row block r (of R) and column block c (of C)."""
    (a, b), (x, y) = chunk_range(n, R, r), chunk_range(n, C, c)
    return max(0, min(b, y) - max(a, x))


def product_elems(kind: str, lowering: str, mesh: tuple, at: tuple, m: int, K: int, N: int,
                  rows_whole: bool = False) -> list:
    """[(mesh axis, elements received)] by the rank at `at` in one product `kind` ('ab', 'abt',
    'atb'), `m` rows of a on this rank; axes of one member receive nothing."""
    (R, C), (r, c) = mesh, at
    gather = lowering == "allgather"
    k_col = _size(K, C, c)  # this rank's block of the contracted dim in a
    if kind == "ab":  # a [m, K/C] b [K/R, N/C]: a's row panel over the columns, b's column panel over the rows
        n = _size(N, C, c)
        over_cols = (C - 1) * m * -(-K // C) if gather else m * (K - k_col)
        over_rows = (R - 1) * -(-K // R) * n if gather else (K - _size(K, R, r)) * n
    elif kind == "abt":  # a [m, K/C] b [N/R, K/C]: b's panel over the rows, the output reduced over the columns
        over_rows = (R - 1) * -(-N // R) * k_col if gather else (N - _size(N, R, r)) * k_col
        over_cols = (C - 1) * m * (-(-N // C) if gather else _size(N, C, c))
    else:  # atb: a [m, K/C] b [m, N/C] -> [K/R, N/C]: a's panel over the columns, the result reduced over the rows
        n = _size(N, C, c)
        if rows_whole:  # each row forms its own block whole: no reduce, only its own block's pieces move
            over_cols = (C - 1) * m * -(-K // C) if gather else m * (_size(K, R, r) - _shared(K, R, r, C, c))
            over_rows = 0
        else:
            over_cols = (C - 1) * m * -(-K // C) if gather else m * (K - k_col)
            over_rows = (R - 1) * n * (-(-K // R) if gather else _size(K, R, r))
    return [(a, e) for a, e in ((0, over_rows), (1, over_cols)) if mesh[a] > 1]


def step_products(transposed: bool, grad_x: bool, grad_w: bool) -> list:
    """The products of one training step of a linear x [M, K] . W -> [M, N], in order, as (phase,
    kind, roles): roles 'KN' when the product contracts K, 'NK' when it contracts N."""
    if transposed:  # W stored [N, K]: ABT; backward dX = AB(dY, W), dW = ATB(dY, x)
        out = [("fwd", "abt", "KN")] + ([("bwd", "ab", "NK")] if grad_x else [])
        return out + ([("bwd", "atb", "NK")] if grad_w else [])
    out = [("fwd", "ab", "KN")] + ([("bwd", "abt", "NK")] if grad_x else [])  # dX = ABT(dY, W)
    return out + ([("bwd", "atb", "KN")] if grad_w else [])  # dW = ATB(x, dY)
