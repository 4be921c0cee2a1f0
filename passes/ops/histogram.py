"""`torch.histc` of a rank's block, also for integer tensors on the CPU.

transformers' MoE code counts the tokens routed to each expert with `histc` of the integer expert
indices when it runs off the CPU; a model built on the meta device is captured with that branch, and
torch has no CPU kernel for an integer histc ("histogram_cpu" not implemented for 'Int'), so neither
the CPU run of such a graph nor `autopar.plan`'s fake-tensor run could execute it. On the CPU the
integers are counted as float64 (exact below 2**53: every bin edge and value is an exact double) and
the counts come back in the input's dtype, as the CUDA kernel returns them.

>>> LocalHistc(bins=4, lo=0, hi=4)(torch.tensor([0, 1, 1, 3, 3, 3]))
tensor([1, 2, 0, 3])
"""

from __future__ import annotations

import torch
import torch.nn as nn


class LocalHistc(nn.Module):
    """`torch.histc(x, bins, lo, hi)` of this rank's block x; its counts are this rank's share."""

    def __init__(self, bins: int, lo: float, hi: float):
        super().__init__()
        self.bins, self.lo, self.hi = bins, lo, hi

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_floating_point() or x.device.type != "cpu":
            return torch.histc(x, self.bins, self.lo, self.hi)
        return torch.histc(x.double(), self.bins, self.lo, self.hi).to(x.dtype)  # [bins]

    def extra_repr(self) -> str:
        return f"bins={self.bins}, min={self.lo}, max={self.hi}"
