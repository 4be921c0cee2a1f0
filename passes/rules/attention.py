"""scaled_dot_product_attention: batch over mesh rows, heads over mesh columns, computed locally.

q, k, v are [b, heads, s, head_dim]. The attention of one (batch, head) pair needs nothing from any
other, so with batch and heads split the op runs on each rank's block with no communication. A mask
broadcasts against [b, heads, s_q, s_k] like an elementwise operand.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Replicate, Shard

from passes.layout import Layout
from passes.rules import Strategy, Unsupported, arg, register, shape
from passes.rules.pointwise import dim_map

aten = torch.ops.aten


@register(aten.scaled_dot_product_attention.default)
def sdpa(node, layouts, mesh):
    query, key, value = node.args[:3]
    mask = arg(node, 3, "attn_mask")
    qs, ks = shape(query), shape(key)
    if len(qs) != 4 or qs[:2] != ks[:2]:
        raise Unsupported("attention with other than [b, heads, s, d] inputs of equal head count")
    lay = Layout(tuple(Shard(d) if qs[d] % mesh[d] == 0 else Replicate() for d in (0, 1)))
    need = {query: lay, key: lay, value: lay}
    if mask is not None:
        full = (qs[0], qs[1], qs[2], ks[2])
        m = {o: i for i, o in dim_map(shape(mask), full).items()}
        need[mask] = Layout(tuple(Shard(m[p.dim]) if isinstance(p, Shard) and p.dim in m else Replicate()
                                  for p in lay.placements))
    return Strategy(need, lay, note="local attention")
