"""What recomputing repeated blocks costs and saves, for the strategy search (`passes.search.strategy`).

A model of N identical blocks whose estimate (`passes.search.estimate`) prices one middle block as `block`:

- kept: recomputing a block keeps only its activation inputs (the residual stream entering it), so
  each recomputed block saves `block.activation_bytes - inputs` bytes per rank;
- transient: backward rebuilds one recomputed block's activations at a time, so recomputing any
  block adds one block's activations to the peak;
- time: the recomputation is the block's forward once more. A training step runs three products per
  matmul (forward, dX, dW) and each SUMMA product its broadcasts, so the forward is priced as a third
  of the block's estimated time (its FLOPs and its communication alike).

`fit` picks the fewest blocks whose recomputation brings the estimate under a memory limit: each
recomputed block costs the same time, so the fewest is the fastest.

>>> t = BlockTrade(blocks=4, ids=("h.0", "h.1", "h.2", "h.3"), saved=100.0, transient=120.0, forward_s=1.0)
>>> t.blocks_for(memory=1000.0, limit=1000.0), t.blocks_for(memory=1100.0, limit=1000.0)
(0, 3)
>>> t.blocks_for(memory=1400.0, limit=1000.0) is None
True
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from passes.layout import Layout, local_shape
from passes.meta import ROLE

__all__ = ["BlockTrade", "block_trade"]


@dataclass(frozen=True)
class BlockTrade:
    blocks: int  # N, the repeated blocks
    ids: tuple  # their module paths, in graph order ('model.layers.0', ...)
    saved: float  # bytes per rank one recomputed block no longer keeps
    transient: float  # bytes per rank of one block's activations, rebuilt in backward
    forward_s: float  # estimated seconds of one block's forward, run again

    def memory_with(self, memory: float, k: int) -> float:
        """The estimate `memory` (no recomputation) with `k` blocks recomputed."""
        return memory if k == 0 else memory - k * self.saved + self.transient

    def blocks_for(self, memory: float, limit: float) -> int | None:
        """The fewest blocks to recompute for `memory` to fit `limit`; None when all of them are not enough."""
        if memory <= limit:
            return 0
        if self.saved <= 0:
            return None
        k = max(1, math.ceil((memory + self.transient - limit) / self.saved))
        return k if k <= self.blocks else None


def _input_bytes(block: list, layouts: dict, mesh, grads: set) -> float:
    """Bytes per rank of the activations a block reads from outside it (parameters excluded)."""
    inside, total = set(block), 0.0
    for a in dict.fromkeys(a for n in block for a in n.all_input_nodes if a not in inside):
        v, lay = a.meta.get("val"), layouts.get(a)
        if a in grads and a.meta.get(ROLE) != "param" and isinstance(v, torch.Tensor) and isinstance(lay, Layout):
            total += math.prod(local_shape(tuple(v.shape), lay, mesh, at=(0, 0))) * v.element_size()
    return total


def block_trade(blocks: list, middle, layouts: dict, mesh, grads: set) -> BlockTrade:
    """The trade for `blocks` (node lists in graph order) from the estimate `middle` of the second one."""
    from passes.nodes import block_of  # passes.strategy imports this module

    inputs = _input_bytes(blocks[1], layouts, mesh, grads)
    return BlockTrade(blocks=len(blocks), ids=tuple(block_of(b[0]) for b in blocks),
                      saved=middle.activation_bytes - inputs, transient=middle.activation_bytes,
                      forward_s=middle.time_s / 3)
