"""What sharded replicas move and hold: FSDP2 (ZeRO-3) over the replica axis of a (dp, R, C) grid.

`autopar.parallel.sharded` counts a real run's FSDP2 collectives against this; `autopar.plan` prices a
grid it has no processes for with it.

>>> t = fsdp_traffic([[((6, 4), 4, True), ((3,), 4, False)]], dp=2)  # one unit: a [6, 4] fp32 block, a frozen [3]
>>> t.calls, t.gather_bytes, t.scatter_bytes, t.shard_bytes
(2, 56, 48, 56)
>>> t = fsdp_traffic([[((3,), 4, True)], [((6, 4), 4, True)], [((6, 4), 4, True)]], dp=2)  # a root, two blocks
>>> t.calls, t.gather_bytes, t.scatter_bytes, t.units
(8, 200, 104, 3)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["FSDPTraffic", "fsdp_traffic", "shard_rows", "unit_groups"]


def shard_rows(rows: int, dp: int) -> int:
    """Rows of each of FSDP2's `dp` chunks of a block's first dim (the block padded to a multiple of dp)."""
    return math.ceil(rows / dp)


def unit_groups(blocks: dict, units) -> list:
    """`blocks` (parameter name -> its block's (shape, element size, trained)) as FSDP2 units: the root's
    first (every parameter under none of `units`), then each unit's (the parameters under its module
    path), as `fsdp_traffic` takes them."""
    groups: list = [[] for _ in range(len(units) + 1)]
    for name, block in blocks.items():
        owner = next((i + 1 for i, u in enumerate(units) if name.startswith(u + ".")), 0)
        groups[owner].append(block)
    return groups


@dataclass(frozen=True)
class FSDPTraffic:
    """What the replica axis moves per rank and training step with data_parallel='shard'."""

    calls: int  # collective calls: each unit's all-gather(s) and reduce-scatter
    gather_bytes: int  # received by the parameters' all-gathers
    scatter_bytes: int  # received by the gradients' reduce-scatters
    shard_bytes: int  # parameter bytes a rank holds between steps (padding included)
    trained_shard_bytes: int  # of those, the parameters that get a gradient
    block_bytes: int  # its grid block of every parameter
    units: int = 1  # FSDP2 units: the root and one per repeated block
    gathered_bytes: int = 0  # most parameter block bytes gathered at once (the root's and two blocks')

    @property
    def received(self) -> int:
        return self.gather_bytes + self.scatter_bytes


def fsdp_traffic(units, dp: int, reshard_after_forward: bool = True) -> FSDPTraffic:
    """FSDP2 over `dp` replicas, per rank and training step. `units`: the root unit's grid blocks, then
    each repeated block's (a unit each), every block given as (shape, element size, trained). A unit's
    all-gather receives (dp - 1)/dp of each of its blocks padded to a multiple of dp on the first dim,
    its reduce-scatter the same share of each trained block; one call each per unit, and a block
    unit resharded after forward (FSDP2's default; never the root) is gathered again for backward."""
    units = [list(u) for u in units]
    gather = scatter = shard = trained_shard = block = calls = 0
    sizes = []
    for i, blocks in enumerate(units):
        g = s = b = 0
        for shape, esize, trained in blocks:
            piece = shard_rows(shape[0] if shape else 1, dp) * math.prod(shape[1:]) * esize  # one replica's chunk
            g += (dp - 1) * piece
            shard += piece
            b += math.prod(shape) * esize
            if trained:
                s += (dp - 1) * piece
                trained_shard += piece
        again = 2 if i > 0 and reshard_after_forward else 1
        gather, scatter, block = gather + again * g, scatter + s, block + b
        calls += again * (g > 0) + (s > 0)
        sizes.append(b)
    if reshard_after_forward and len(sizes) > 1:  # the unit running and the one prefetched
        gathered = sizes[0] + sum(sorted(sizes[1:])[-2:])
    else:
        gathered = block
    return FSDPTraffic(calls, gather, scatter, shard, trained_shard, block, len(units), gathered)
