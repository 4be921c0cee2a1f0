"""The schedule of the rotating (ring) lowering of a SUMMA product: who sends which piece to whom, at
which step. Arithmetic only: `passes.ops.ring` runs it, and the planner counts its calls from it.

A product's shared dim is cut into the pieces of `segments` (S of them: q on a q x q grid with even
blocks). The broadcast lowering runs piece t at step t on every rank, so all the members of a group
need the same piece at once and its owner broadcasts it. The rotating lowering runs, on the rank at
grid position (r, c), piece (t + r + c) mod S at step t: the alignment of Cannon's algorithm. On a
q x q grid each step is then a permutation within every row and every column: each member needs a
different member's piece, so each rank sends one piece and receives one per step and axis, point to
point. Partial sums travel the same way in reverse: at step t a rank sends the partial sum of its piece
to the piece's owner, which adds it to its block.

>>> segs = segments(8, 2, 2)  # K = 8 on a 2 x 2 grid: two pieces, of members 0 and 1
>>> [exchange(segs, OWNER, (2, 2), (1, 0), 1, step) for step in (0, 1)]  # rank (1, 0)'s row: a's pieces
[Exchange(src=1, dsts=(1,)), Exchange(src=None, dsts=())]
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["segments", "piece_at", "Exchange", "exchange", "product_segments", "product_calls", "OWNER", "DEST"]


def segments(D: int, src_parts: int, dst_parts: int) -> list:
    """Cut a dim of size D at the block boundaries of both a `src_parts`-way and a `dst_parts`-way
    split (torch.chunk blocks: blocks of ceil(D / parts)): [(start, stop, src block, dst block)]. Square
    grids give the q blocks themselves; an R x C grid gives R + C - gcd(R, C) pieces when both divide D.

    >>> segments(6, 2, 3)
    [(0, 2, 0, 0), (2, 3, 0, 1), (3, 4, 1, 1), (4, 6, 1, 2)]
    """
    a, b = -(-D // src_parts), -(-D // dst_parts)
    cuts = sorted({min(i * a, D) for i in range(src_parts)} | {min(j * b, D) for j in range(dst_parts)} | {D})
    return [(s, e, s // a, s // b) for s, e in zip(cuts, cuts[1:])]


def piece_at(n_pieces: int, step: int, at: tuple) -> int:
    """The piece the rank at grid position `at` = (r, c) works on at `step`."""
    return (step + at[0] + at[1]) % n_pieces


class Exchange(NamedTuple):
    """One rank's point-to-point traffic over one mesh axis at one step: `src`, the member whose piece
    it needs (None: its own, or an empty piece), and `dsts`, the members that need its piece."""

    src: int | None
    dsts: tuple


OWNER, DEST = 2, 3  # the entry of a segment naming the member that holds a piece, and the other split's


def exchange(segs: list, role: int, mesh: tuple, at: tuple, axis: int, step: int) -> Exchange:
    """Who sends to whom over mesh `axis` at `step`, for the rank at `at`: each member works on the piece
    of `segs` that `piece_at` gives it, and that piece belongs to the member `seg[role]` of the axis's
    group (`OWNER` or `DEST`). For an operand, the rank receives from `src` and sends its piece to
    `dsts`; for a partial sum, the other way round (it sends its partial to `src`, the piece's owner,
    and receives the partials of `dsts`). Empty pieces move nothing."""
    S, (r, c) = len(segs), at
    own = at[axis]

    def piece(member: int) -> tuple:
        return segs[piece_at(S, step, (member, c) if axis == 0 else (r, member))]

    def moves(seg: tuple, member: int) -> bool:
        return seg[role] != member and seg[1] > seg[0]

    mine = piece(own)
    src = mine[role] if moves(mine, own) else None
    dsts = tuple(m for m in range(mesh[axis]) if m != own and piece(m)[role] == own and piece(m)[1] > piece(m)[0])
    return Exchange(src, dsts)


def product_segments(kind: str, mesh: tuple, K: int, N: int) -> tuple:
    """(segments, [(axis, role)]) of one product `kind`: the pieces of its shared dim and, per mesh axis,
    which entry of a piece names the member it moves to or from (see `passes.ops.ring`)."""
    R, C = mesh
    if kind == "abt":  # b's rows (N) over the column group, the output's columns over the row group
        return segments(N, R, C), [(0, OWNER), (1, DEST)]
    return segments(K, C, R), [(1, OWNER), (0, DEST)]  # ab: a over the rows, b over the columns; atb alike


def product_calls(kind: str, mesh: tuple, at: tuple, K: int, N: int) -> int:
    """Point-to-point batches the rank at `at` launches in one product: one per step and mesh axis on
    which it sends or receives anything (q - 1 per axis on a q x q grid with even blocks).

    >>> product_calls("ab", (2, 2), (0, 1), 8, 8), product_calls("ab", (3, 3), (2, 1), 9, 9)
    (2, 4)
    """
    segs, axes = product_segments(kind, mesh, K, N)
    moves = (exchange(segs, role, mesh, at, axis, t) for t in range(len(segs)) for axis, role in axes if mesh[axis] > 1)
    return sum(1 for x in moves if x.src is not None or x.dsts)
