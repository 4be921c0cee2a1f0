"""What sharded replicas move and hold: FSDP2 (ZeRO-3) over the replica axis of a (dp, R, C) grid.

`autopar.parallel.sharded` counts a real run's FSDP2 collectives against this; `autopar.plan` prices a
grid it has no processes for with it.

>>> t = fsdp_traffic([((6, 4), 4, True), ((3,), 4, False)], dp=2)  # a [6, 4] fp32 block, a frozen [3]
>>> t.calls, t.gather_bytes, t.scatter_bytes, t.shard_bytes
(2, 56, 48, 56)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["FSDPTraffic", "fsdp_traffic", "shard_rows"]


def shard_rows(rows: int, dp: int) -> int:
    """Rows of each of FSDP2's `dp` chunks of a block's first dim (the block padded to a multiple of dp)."""
    return math.ceil(rows / dp)


@dataclass(frozen=True)
class FSDPTraffic:
    """What the replica axis moves per rank and training step with data_parallel='shard'."""

    calls: int  # collective calls: the all-gather and the reduce-scatter
    gather_bytes: int  # received by the parameters' all-gather
    scatter_bytes: int  # received by the gradients' reduce-scatter
    shard_bytes: int  # parameter bytes a rank holds between steps (padding included)
    trained_shard_bytes: int  # of those, the parameters that get a gradient
    block_bytes: int  # its grid block of every parameter, gathered for the step

    @property
    def received(self) -> int:
        return self.gather_bytes + self.scatter_bytes


def fsdp_traffic(blocks, dp: int) -> FSDPTraffic:
    """FSDP2 over `dp` replicas of grid blocks given as (shape, element size, trained) each, per rank
    and training step: the parameters' all-gather receives (dp - 1)/dp of each block padded to a
    multiple of dp on its first dim, the gradients' reduce-scatter the same share of every trained
    block; one call each."""
    gather = scatter = shard = trained_shard = block = 0
    for shape, esize, trained in blocks:
        piece = shard_rows(shape[0] if shape else 1, dp) * math.prod(shape[1:]) * esize  # one replica's chunk
        gather += (dp - 1) * piece
        shard += piece
        if trained:
            scatter += (dp - 1) * piece
            trained_shard += piece
        block += math.prod(shape) * esize
    return FSDPTraffic((gather > 0) + (scatter > 0), gather, scatter, shard, trained_shard, block)
