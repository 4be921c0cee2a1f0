"""What context parallelism moves per rank (`passes.ops.context`), with `passes.cost.volumes`' conventions.

In the all-gather flavour an attention's keys and values are all-gathered over the cp ranks forward and their
gradients reduce-scattered back backward: with N bytes in one rank's block of K (and of V),

>>> attention_bytes(1000, 4)
(6000, 6000)

In the all-to-all flavour q, k, v and the output each cross once forward and once backward, every rank
receiving (cp - 1)/cp of the block: with 2000 bytes of q (and of the output) and 1000 of k (and of v),

>>> alltoall_bytes(2000, 1000, 4)
(4500, 4500)

In the ring flavour K and V pass around the ring, their gradients' sums with them backward:

>>> ring_bytes(1000, 4)
(6000, 14000)
"""

from __future__ import annotations

import math

from passes.cost.volumes import all_gather_bytes, all_reduce_bytes, all_to_all_bytes, reduce_scatter_bytes

__all__ = ["FLAVOURS", "alltoall_bytes", "attention_bytes", "can_run", "flavour", "loss_bytes", "output_bytes",
           "ring_bytes", "step_bytes"]


FLAVOURS = ("alltoall", "ring", "allgather")  # how an attention sees the other cp ranks' tokens


def flavour(heads: int, kv_heads: int, cp: int, want: str = "auto", dropout: bool = False) -> str:
    """How an attention with this rank's `heads` query and `kv_heads` KV heads runs over cp ranks
    (`passes.ops.context`): `want`, one of FLAVOURS, or 'auto': 'alltoall' where both divide by cp, else
    'ring' ('allgather' with dropout, which the ring's block products do not draw)."""
    if want != "auto":
        return want
    if heads % cp == 0 and kv_heads % cp == 0:
        return "alltoall"
    return "allgather" if dropout else "ring"


def can_run(want: str, heads: int, kv_heads: int, cp: int, dropout: bool) -> str | None:
    """Why flavour `want` cannot run such an attention, or None."""
    if want == "alltoall" and (heads % cp or kv_heads % cp):
        return (f"the all-to-all flavour splits the heads over the cp ranks: this rank's {heads} query and "
                f"{kv_heads} KV heads must divide by cp={cp}")
    if want == "ring" and dropout:
        return "the ring flavour draws no attention dropout"
    return None


def step_bytes(q_shape: tuple, k_shape: tuple, itemsize: int, cp: int, kind: str) -> tuple:
    """(forward, backward) bytes one rank receives for one attention whose local q is `q_shape` and k (and v)
    `k_shape` ([b, heads, s/cp, d]), in flavour `kind`."""
    q, k = math.prod(q_shape) * itemsize, math.prod(k_shape) * itemsize
    if kind == "alltoall":
        return alltoall_bytes(q, k, cp)
    if kind == "ring":
        return ring_bytes(k, cp)
    return attention_bytes(k, cp)


def ring_bytes(kv_block: int, cp: int) -> tuple:
    """(forward, backward) bytes one rank receives for one attention in the ring flavour, K's and V's blocks
    `kv_block` bytes each: cp − 1 K/V blocks forward; backward cp − 1 again and cp blocks of their gradients'
    running sums (`passes.ops.ring_attention`)."""
    return (cp - 1) * 2 * kv_block, (2 * cp - 1) * 2 * kv_block


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
