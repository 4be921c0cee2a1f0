"""What context parallelism moves per rank (`passes.ops.context`), with `passes.cost.volumes`' conventions.

An attention's keys and values are all-gathered over the cp ranks forward and their gradients
reduce-scattered back backward: with N bytes in one rank's block of K (and of V),

>>> attention_bytes(1000, 4)
(6000, 6000)
"""

from __future__ import annotations

from passes.cost.volumes import all_gather_bytes, all_reduce_bytes, reduce_scatter_bytes

__all__ = ["attention_bytes", "loss_bytes", "output_bytes"]


def attention_bytes(kv_block: int, cp: int) -> tuple:
    """(forward, backward) bytes one rank receives for one attention whose K and V blocks hold `kv_block` bytes
    each: two all-gathers, then two reduce-scatters of the cp-times-larger gathered gradients."""
    return 2 * all_gather_bytes(kv_block, cp), 2 * reduce_scatter_bytes(cp * kv_block, cp)


def output_bytes(block: int, cp: int) -> int:
    """Forward bytes of gathering one output with a sequence dim (its backward takes this rank's part: none)."""
    return all_gather_bytes(block, cp)


def loss_bytes(itemsize: int, cp: int) -> int:
    """Forward bytes of summing the model's loss (one number) over the cp ranks."""
    return all_reduce_bytes(itemsize, cp)
