"""Embedding lookup and cross-entropy over a split vocabulary.

Embedding: the table [V, h] is stored 2D, vocab block r and hidden block c on rank (r, c) -- the
layout an LM head tied to it uses as SUMMA ABT. A vocabulary the grid does not divide (GPT-2's
50257) is split in torch.chunk blocks, as DTensor's Shard cuts it: ceil(V/q) rows, the last block
shorter. Every rank looks up the ids that fall in its vocab block (the others give zero rows), so
the result [..., h] is a partial sum over the mesh rows with the hidden dim split over the columns;
the consumer turns it into batch blocks with one reduce-scatter.

Cross-entropy: logits [N, V] with rows over mesh rows and vocab over columns. The max, the sum of
exponentials and the target logit are all-reduced in the same-row group, the mean over tokens in the
same-column group; the full logits are never gathered. Backward is local. A vocabulary the columns
do not divide is split in torch.chunk blocks (some may be empty), which the kernel places by V. A
row count the mesh rows do not divide (a ragged last batch) stays whole on every row, and the mean
needs no column sum.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from passes.kernels.local import CrossEntropySpec, EmbeddingSpec
from passes.layout import REPLICATED, Layout, uneven_ok
from passes.meta import CHOICE
from passes.rules.registry import Strategy, Unsupported, register
from passes.nodes import arg, shape, val

aten = torch.ops.aten


@register(aten.embedding.default)
def embedding(node, layouts, mesh):
    table, ids = node.args[:2]
    V, h = shape(table)
    have = layouts.get(table)
    if have is None and node.meta.get(CHOICE) in ("1d", "col") and (V % mesh[1] == 0 or uneven_ok(mesh)):
        have = Layout((Replicate(), Shard(0)))  # 1D: vocab over the columns (Megatron's vocab-parallel table)
    if have is None:  # a vocabulary R does not divide is split in torch.chunk blocks (indivisible='uneven')
        # or kept whole with the hidden split (an LM head tied to it then runs a local matmul whose
        # output is a partial sum over the columns)
        vocab_split = V % mesh[0] == 0 or uneven_ok(mesh)
        hidden_split = h % mesh[1] == 0 or uneven_ok(mesh)
        have = Layout((Shard(0), Shard(1))) if vocab_split and hidden_split else (
            Layout((Replicate(), Shard(1))) if hidden_split else REPLICATED)
    vocab_axis = have.shard_axis(0)
    hidden_axis = have.shard_axis(1)
    nd = len(val(node).shape)
    out = [Replicate(), Replicate()]
    if vocab_axis is not None:
        out[vocab_axis] = Partial("sum")
    if hidden_axis is not None:
        out[hidden_axis] = Shard(nd - 1)
    return Strategy(
        {table: have, ids: REPLICATED},
        Layout(tuple(out)),
        kernel=EmbeddingSpec(vocab_axis) if vocab_axis is not None else None,
        note="vocab-split lookup" if vocab_axis is not None else "",
    )


@register(aten.cross_entropy_loss.default)
def cross_entropy(node, layouts, mesh):
    logits, target = node.args[:2]
    weight = arg(node, 2, "weight")
    reduction = arg(node, 3, "reduction", 1)
    smoothing = arg(node, 5, "label_smoothing", 0.0)
    ls = shape(logits)
    if len(ls) != 2 or weight is not None or reduction not in (1, 2) or smoothing:
        raise Unsupported("cross_entropy other than mean or sum over [N, V] logits without weights/smoothing")
    # a ragged batch: torch.chunk blocks of the rows (the loss sums them and their true count over
    # the mesh rows), or, without uneven splits, every mesh row takes all of them
    rows_whole = ls[0] % mesh[0] != 0 and not uneven_ok(mesh)
    rows = Replicate() if rows_whole else Shard(0)
    # else each row block holds whole rows of logits; uneven: torch.chunk blocks of the vocabulary
    vocab_split = ls[1] % mesh[1] == 0 or uneven_ok(mesh)
    return Strategy(
        {logits: Layout((rows, Shard(1) if vocab_split else Replicate())), target: Layout((rows, Replicate()))},
        REPLICATED,
        kernel=CrossEntropySpec(vocab_split=vocab_split, reduce_sum=reduction == 2, rows_whole=rows_whole),
        note="vocab-parallel cross-entropy" if vocab_split else "cross-entropy on row blocks (vocab whole)",
    )
