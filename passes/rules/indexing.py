"""Advanced indexing, `x[idx]`: aten.index.Tensor(x, [None, ..., idx, ...]).

The index tensors (integer, broadcast together to shape B) pick positions along the dims they stand
at; a None keeps a dim whole. Each rank can index its own block when the indexed dims are whole on it:
the rule gathers x along the indexed dims only (and makes a partial sum whole), keeps every other
split, and asks for the index tensors whole. The kept dims land where indexing puts them:

- index tensors at adjacent positions i..j: out = x.shape[:i] + B + x.shape[j+1:]
  (`x[:, :, [-2]]`, Falcon's key head; `x[arange, pos]` on dims 0 and 1);
- separated by a None: out = B + the non-indexed dims in order (torch's rule for that case).

A boolean mask index (`x[mask]`) has a data-dependent size and is left to the fallback.

>>> # x [b, s, 6, d] laid out S(0)S(2), x[:, :, [4]]: heads gathered, batch kept: out [b, s, 1, d] S(0)R
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Replicate

from passes.layout import REPLICATED, Layout, moved, split_dim
from passes.rules.registry import Strategy, Unsupported, register, whole_along
from passes.nodes import shape, val
from passes.rules.moe.expert_rows import rows_index

aten = torch.ops.aten


def _out_dims(nd: int, indexed: list, width: int) -> dict:
    """Input dim -> output dim for the dims no index tensor stands at; `width` = len(B)."""
    kept = [d for d in range(nd) if d not in indexed]
    if indexed == list(range(indexed[0], indexed[-1] + 1)):  # adjacent: B takes their place
        return {d: d if d < indexed[0] else d - len(indexed) + width for d in kept}
    return {d: width + k for k, d in enumerate(kept)}


@register(aten.index.Tensor)
def index(node, layouts, mesh):
    x, idx = node.args[0], list(node.args[1])
    nd = len(shape(x))
    indexed = [d for d, t in enumerate(idx) if t is not None]
    if not indexed:
        raise Unsupported("index with no index tensor")
    tensors = [idx[d] for d in indexed]
    if any(val(t).dtype in (torch.bool, torch.uint8) for t in tensors):
        raise Unsupported("index by a boolean mask (its result size depends on the data)")
    width = len(torch.broadcast_shapes(*(shape(t) for t in tensors)))
    to = _out_dims(nd, indexed, width)
    rows = rows_index(x, layouts.get(x), indexed)
    if rows is not None and x not in tensors:  # the experts' results put back in token order
        return Strategy({**{t: REPLICATED for t in tensors}, x: rows}, rows)
    lay = whole_along(layouts, x, indexed[0])
    if x in tensors:  # x indexes itself: it arrives whole once
        lay = REPLICATED
    for d in indexed[1:]:
        lay = Layout(tuple(Replicate() if split_dim(p) == d else p for p in lay.placements))
    out = Layout(tuple(moved(p, to[p.dim]) if split_dim(p) is not None else p for p in lay.placements))
    return Strategy({**{t: REPLICATED for t in tensors}, x: lay}, out)


@register(aten.index_copy_.default, aten.index_copy.default)
def index_copy(node, layouts, mesh):
    """`cache.index_copy_(dim, pos, new)` (a static KV cache written at the new tokens' slots): each
    rank writes its block of `new` into its block of `cache`, so `dim` must be whole in the cache's
    layout; `new` is brought to that layout and the positions arrive whole."""
    x, dim, index, src = node.args[:4]
    nd = len(shape(x))
    lay = (layouts.get(x) or REPLICATED).normalized(nd)
    if lay.has_partial:
        raise Unsupported("index_copy into a partial sum")
    if any(split_dim(p) == dim % nd for p in lay.placements):
        raise Unsupported(f"index_copy along dim {dim}, which is split")
    return Strategy({x: lay, index: REPLICATED, src: lay}, lay)
