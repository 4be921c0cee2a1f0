"""The grouped expert matmul of transformers 5 on a rank's block of the experts.

transformers' `*Experts` modules sort the routed (token, expert) pairs by expert and run one
`grouped_mm(x [S, K], w [E, K, N], offs [E])`: the rows offs[e-1]:offs[e] of x go through expert
e's matrix. With the experts split over the grid's rows (torch.chunk blocks, `passes.layout.chunk_range`),
row r holds experts [lo, hi), whose rows of x are the contiguous run offs[lo-1]:offs[hi-1]; it
multiplies that run alone and leaves every other row zero. Summed over the grid's rows this is the
whole product, each row coming from exactly one member: the layout `passes.rules.moe.experts.EXPERT_ROWS`.

The run's two edges are read on the host in one read (transformers' own fallback reads every offset
with `tolist()`), so the run's length is known when the matmul starts. A planning run on
fake tensors has no offsets to read: it takes the routing as spread evenly over the experts.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from passes import compat
from passes.compat import is_fake
from passes.layout import chunk_range
from passes.mesh import Grid


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, aten: bool) -> torch.Tensor:
    """The grouped matmul the captured graph calls: torch's own (`aten`, what transformers uses with
    bf16 weights) or transformers' registered fallback (fp32). A run of no rows multiplies nothing
    (torch's CPU kernel has no backward for it) but keeps w in the autograd graph: its gradient is zero."""
    if x.shape[0] == 0:
        return torch.einsum("sk,ekn->sn", x, w)  # [0, N']
    if aten:
        return compat.grouped_mm(x, w, offs)
    return torch.ops.transformers.grouped_mm_fallback(x, w, offs)


def _run(offs: torch.Tensor, lo: int, hi: int, rows: int, experts: int) -> tuple:
    """[start, stop) of the rows that experts [lo, hi) own."""
    if is_fake(offs):
        return rows * lo // experts, rows * hi // experts
    if hi == lo:  # no experts on this row
        return (0, 0) if lo == 0 else tuple(offs[lo - 1:lo].tolist()) * 2
    ends = offs[hi - 1:hi].tolist() if lo == 0 else offs[lo - 1:hi:hi - lo].tolist()  # one host read
    return (0, ends[0]) if lo == 0 else (ends[0], ends[1])


class ExpertBlockMM(nn.Module):
    """`grouped_mm` on this rank's experts: x [S, K'] (every routed row, or only this row's, the others
    zero), w [E/R, K', N'] (this rank's experts; K' and N' blocks of K and N), offs [E] whole.
    Returns [S, N'], zero outside this rank's run of rows; with `split` False the experts are whole and
    it is transformers' op as captured."""

    def __init__(self, grid: Grid, experts: int, split: bool, aten: bool = False):
        super().__init__()
        self.grid, self.experts, self.split, self.aten = grid, experts, split, aten

    def forward(self, x, w, offs):
        if not self.split:
            return grouped_mm(x, w, offs, self.aten)
        lo, hi = chunk_range(self.experts, self.grid.shape[0], self.grid.r)
        start, stop = _run(offs, lo, hi, x.shape[0], self.experts)
        rows = grouped_mm(x[start:stop], w, (offs[lo:hi] - start).to(offs.dtype), self.aten)  # [run, N']
        return F.pad(rows, (0, 0, start, x.shape[0] - stop))  # [S, N']; pad's backward drops other rows

    def extra_repr(self) -> str:
        return f"experts={self.experts}, split={self.split}, aten={self.aten}"
