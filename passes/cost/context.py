"""What context parallelism moves per rank (`passes.ops.context`), with `passes.cost.volumes`' conventions.

In the all-gather flavour an attention's keys and values are all-gathered over the cp ranks forward and their
gradients reduce-scattered back backward: with N bytes in one rank's block of K (and of V),

>>> attention_bytes(1000, 4)
(6000, 6000)

In the all-to-all flavour q, k, v and the output each cross once forward and once backward, every rank
receiving (cp - 1)/cp of the block: with 2000 bytes of q (and of the output) and 1000 of k (and of v),

>>> alltoall_bytes(2000, 1000, 4)
(4500, 4500)
"""

from __future__ import annotations

import math

from passes.cost.volumes import all_gather_bytes, all_reduce_bytes, all_to_all_bytes, reduce_scatter_bytes

__all__ = ["alltoall_bytes", "attention_bytes", "flavour", "loss_bytes", "output_bytes", "step_bytes"]


def flavour(heads: int, kv_heads: int, cp: int) -> str:
    """How an attention with this rank's `heads` query and `kv_heads` KV heads runs over cp ranks
    (`passes.ops.context`): 'alltoall' where both divide by cp, else 'allgather'."""
    return "alltoall" if heads % cp == 0 and kv_heads % cp == 0 else "allgather"


def step_bytes(q_shape: tuple, k_shape: tuple, itemsize: int, cp: int) -> tuple:
    """(forward, backward) bytes one rank receives for one attention whose local q is `q_shape` and k `k_shape`
    ([b, heads, s/cp, d]), in the flavour its heads take."""
    q, k = math.prod(q_shape) * itemsize, math.prod(k_shape) * itemsize
    if flavour(q_shape[1], k_shape[1], cp) == "alltoall":
        return alltoall_bytes(q, k, cp)
    return attention_bytes(k, cp)


def attention_bytes(kv_block: int, cp: int) -> tuple:
    """(forward, backward) bytes one rank receives for one attention whose K and V blocks hold `kv_block` bytes
    each: two all-gathers, then two reduce-scatters of the cp-times-larger gathered gradients."""
    return 2 * all_gather_bytes(kv_block, cp), 2 * reduce_scatter_bytes(cp * kv_block, cp)


def alltoall_bytes(q_block: int, kv_block: int, cp: int) -> tuple:
    """(forward, backward) bytes one rank receives for one attention in the all-to-all flavour, with q's (and the
    output's) block of `q_block` bytes and k's (and v's) of `kv_block`."""
    one = sum(all_to_all_bytes([1] * cp, 0, n // cp) for n in (q_block, kv_block, kv_block, q_block))
    return one, one


def output_bytes(block: int, cp: int) -> int:
    """Forward bytes of gathering one output with a sequence dim (its backward takes this rank's part: none)."""
    return all_gather_bytes(block, cp)


def loss_bytes(itemsize: int, cp: int) -> int:
    """Forward bytes of summing the model's loss (one number) over the cp ranks."""
    return all_reduce_bytes(itemsize, cp)
