"""scaled_dot_product_attention: batch over mesh rows, heads over mesh columns, computed locally.

q is [b, hq, s, d], k and v are [b, hkv, s_k, d] with hkv == hq, or fewer KV heads: multi-query
(hkv == 1, broadcast or `enable_gqa`) and grouped-query (`enable_gqa`, hq = g * hkv, query head h
reads KV head h // g). The attention of one (batch, head) pair needs nothing from any other, so with
batch and heads split the op runs on each rank's block with no communication:

- hkv == hq: k and v are split like q.
- grouped, hkv divisible by the C columns: column c holds query heads [c hq/C, (c+1) hq/C), which
  read exactly KV heads [c hkv/C, (c+1) hkv/C), and the local group size is still hq/C / (hkv/C) = g;
  so k and v are split over the columns like q.
- one KV head: every query head reads it; k and v stay whole over the columns (each column holds the
  [b/R, 1, s_k, d] block, no more than one head), and their gradient, one share per column, is summed
  over the columns by the GradSync that `insert_collectives` puts on any input replicated over an axis
  its consumer's output is split over.
- grouped, hkv not divisible by C (5 KV heads, or fewer KV heads than columns): a column's query
  heads read a slice of the KV heads that differs per column. With indivisible='uneven' k and v stay
  whole over the columns and a kernel (`GroupedHeadsSpec`) picks, on each column, the KV head each of
  its query heads reads, as vLLM replicates only the KV heads a rank needs; their gradients are summed
  over the columns by a GradSync. Otherwise the heads stay whole (batch still split).

A head count (or batch) the grid does not divide is split in torch.chunk blocks (indivisible='uneven':
25 heads on 8 columns are blocks of 4, the seventh column 1, the last none) when k and v have q's heads
or one head; q, k and v then hold the same heads.

A mask broadcasts against [b, hq, s_q, s_k] like an elementwise operand.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Replicate, Shard

from passes.kernels.local import GroupedHeadsSpec
from passes.layout import Layout, uneven_ok
from passes.rules.registry import Strategy, Unsupported, register
from passes.nodes import arg, shape
from passes.rules.pointwise import dim_map

aten = torch.ops.aten


def _split(size: int, q: int, dim: int, uneven: bool):
    return Shard(dim) if size % q == 0 or uneven else Replicate()


def kv_layout(qs: tuple, ks: tuple, gqa: bool, mesh: tuple) -> tuple:
    """(q's layout, k's and v's layout, whether the columns pick their KV heads) for q of shape `qs` and
    k of shape `ks`."""
    uneven = uneven_ok(mesh)
    batch = _split(qs[0], mesh[0], 0, uneven)
    kv_batch = batch if ks[0] == qs[0] else Replicate()  # a k/v batch of 1 broadcasts
    heads = _split(qs[1], mesh[1], 1, uneven)
    if ks[1] == qs[1]:
        kv_heads = heads
    elif ks[1] == 1:  # multi-query: the one KV head serves every column's query heads
        kv_heads = Replicate()
    elif gqa and ks[1] % mesh[1] == 0 and qs[1] % mesh[1] == 0:
        kv_heads = heads  # contiguous groups: column c's query heads read column c's KV heads
    elif gqa and uneven and isinstance(heads, Shard) and mesh[1] > 1:
        # each column picks the KV heads its query heads read from k and v whole over the columns
        return Layout((batch, heads)), Layout((kv_batch, Replicate())), True
    else:
        heads = kv_heads = Replicate()
    return Layout((batch, heads)), Layout((kv_batch, kv_heads)), False


@register(aten.scaled_dot_product_attention.default)
def sdpa(node, layouts, mesh):
    query, key, value = node.args[:3]
    mask = arg(node, 3, "attn_mask")
    gqa = bool(node.kwargs.get("enable_gqa", False))
    qs, ks, vs = shape(query), shape(key), shape(value)
    if len(qs) != 4 or len(ks) != 4 or len(vs) != 4:
        raise Unsupported(f"attention with other than 4-d [b, heads, s, d] inputs: q {qs}, k {ks}, v {vs}")
    grouped = ks[1] == qs[1] or ks[1] == 1 or (gqa and qs[1] % ks[1] == 0)
    if ks[:2] != vs[:2] or ks[0] not in (qs[0], 1) or not grouped:
        raise Unsupported(f"attention with k/v batch or heads that neither match nor group q's: q {qs}, k {ks}, "
                          f"v {vs}, enable_gqa={gqa}")
    lay, kv, pick = kv_layout(qs, ks, gqa, mesh)
    need = {query: lay, key: kv, value: kv}
    if mask is not None:
        full = (qs[0], qs[1], qs[2], ks[2])
        m = {o: i for i, o in dim_map(shape(mask), full).items()}
        need[mask] = Layout(tuple(Shard(m[p.dim]) if isinstance(p, Shard) and p.dim in m else Replicate()
                                  for p in lay.placements))
    if pick:
        return Strategy(need, lay, kernel=GroupedHeadsSpec(), note="local attention, KV heads picked per column")
    return Strategy(need, lay, note="local attention")
