"""Kernel specs of the ops that run on their blocks, exchanging at most per-row statistics or a weight
block: LayerNorm/RMSNorm over a split hidden dim, batch norm, convolutions, attention with KV heads
picked per column, the vocab-split embedding and the vocab-parallel cross-entropy. What a spec is and
the SUMMA, redistribution and gradient-sync specs: `passes.kernels.spec`.

>>> ce = CrossEntropySpec(vocab_split=True, reduce_sum=False)  # r rows of logits per rank
>>> ce.steps(None, {k: symbol(k) for k in "RCr"}, exact=True)
[(1, 'fwd', floor(4*r*(2*C - 2)/C)), (1, 'fwd', floor(8*r*(2*C - 2)/C)), (0, 'fwd', floor((24*R - 24)/R))]
>>> ce.steps(None, {"R": 2, "C": 4, "r": 8}, exact=False)
[(1, 'fwd', 48), (1, 'fwd', 96), (0, 'fwd', 12)]
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from passes.cost.volumes import all_gather_bytes, all_reduce_bytes
from passes.nodes import arg, module_path
from passes.kernels.spec import KernelSpec, symbol  # noqa: F401  (symbol: the doctest)
from passes.ops import conv_norm
from passes.ops import modules as kernels


@dataclass(frozen=True)
class NormSpec(KernelSpec):
    """LayerNorm (`centered`) or RMSNorm over a hidden dim split over the mesh columns
    (`kernels.ShardedNorm`): per-token statistics all-reduced in the row, `kernels.NORM_STATS` of them."""

    centered: bool
    name: ClassVar[str] = "norm"

    def operands(self, node):
        # layer_norm(x, shape, w, b, eps, cudnn); rms_norm(x, shape, w, eps)
        a = list(node.args) + [None] * 4
        return a[0], a[2], a[3] if self.centered else None

    def build(self, node, grid, lowering):
        a = list(node.args) + [None] * 5
        eps = (1e-5 if a[4] is None else a[4]) if self.centered else a[3]
        return kernels.ShardedNorm(grid, a[1][-1], eps, self.centered, node.name), self.operands(node)

    def describe(self, site):
        fwd, bwd = kernels.NORM_STATS[self.centered]
        return f"all-reduce x{len(fwd)} (row) stats; bwd x{len(bwd)}"

    def values(self, site):
        return {"C": site.mesh[1], "t": math.prod(site.local_out()[:-1])}  # t: tokens this rank normalizes

    def steps(self, site, v, exact):
        size = kernels.norm_stat_size(site.val(0).dtype)
        fwd, bwd = kernels.NORM_STATS[self.centered]
        calls = [("fwd", k) for k in fwd] + ([("bwd", k) for k in bwd] if site.grads[0] else [])
        return [(1, phase, all_reduce_bytes(k * size * v["t"], v["C"], exact)) for phase, k in calls]


@dataclass(frozen=True)
class GroupedHeadsSpec(KernelSpec):
    """Attention with query heads over the mesh columns and KV heads whole over them, when the columns
    do not divide the KV heads (`kernels.GroupedHeadsAttention`): no communication of its own."""

    name: ClassVar[str] = "gqa"
    local: ClassVar[bool] = True

    def operands(self, node):

        mask = arg(node, 3, "attn_mask")
        return tuple(node.args[:3]) + ((mask,) if mask is not None else ())

    def build(self, node, grid, lowering):

        q, k = node.args[0].meta["val"], node.args[1].meta["val"]
        module = kernels.GroupedHeadsAttention(grid, q.shape[1], k.shape[1], arg(node, 4, "dropout_p", 0.0),
                                               arg(node, 5, "is_causal", False), node.kwargs.get("scale"))
        return module, self.operands(node)


@dataclass(frozen=True)
class ConvSpec(KernelSpec):
    """A convolution run split (`conv_norm.SplitConv`): a grouped one (`grouped`: groups the columns
    divide) on whole groups per column, no communication; with `gathered`, a weight stored split over
    the rows by input channel: an all-gather of its block in the column forward, a reduce-scatter of
    its gradient backward."""

    grouped: bool
    gathered: bool
    name: ClassVar[str] = "conv"

    def operands(self, node):

        return node.args[0], node.args[1], arg(node, 2, "bias")

    def build(self, node, grid, lowering):

        dims = len(node.args[1].meta["val"].shape) - 2
        one, zero = [1] * dims, [0] * dims
        groups = arg(node, 6, "groups", 1) // (grid.shape[1] if self.grouped else 1)
        module = conv_norm.SplitConv(grid, dims, groups, arg(node, 3, "stride", one), arg(node, 4, "padding", zero),
                                   arg(node, 5, "dilation", one), node.name, self.gathered)
        return module, self.operands(node)

    def describe(self, site):
        return "all-gather (column) weight; bwd reduce-scatter" if self.gathered else ""

    def values(self, site):
        return {"R": site.mesh[0], "w": math.prod(site.local(1)) * site.val(1).element_size()} if self.gathered else {}

    def steps(self, site, v, exact):
        if not self.gathered:
            return []
        # backward's reduce-scatter of the gathered weight's gradient receives what the gather did
        moved = all_gather_bytes(v["w"], v["R"])
        return [(0, "fwd", moved)] + ([(0, "bwd", moved)] if site.grads[1] else [])


@dataclass(frozen=True)
class BatchNormSpec(KernelSpec):
    """Training-mode batch norm (`conv_norm.SplitBatchNorm`): with the batch over the mesh rows (`rows`),
    per-channel statistics all-reduced in the column, `conv_norm.BN_STATS` of them per channel; with the
    channels over the columns (`cols`) and running statistics (`running`), the new mean and variance of
    every channel all-gathered in the row to update the whole buffers."""

    rows: bool
    cols: bool
    running: bool
    name: ClassVar[str] = "bnorm"

    def operands(self, node):
        return tuple(node.args[:5])

    def build(self, node, grid, lowering):
        momentum, eps = node.args[6], node.args[7]
        return conv_norm.SplitBatchNorm(grid, momentum, eps, node.name, self.rows, self.cols), self.operands(node)

    def describe(self, site):
        fwd, bwd = conv_norm.BN_STATS
        parts = [f"all-reduce x{len(fwd)} (column) stats; bwd x{len(bwd)}"] if self.rows else []
        return "; ".join(parts + (["all-gather (row) running stats"] if self.cols and self.running else []))

    def values(self, site):
        return {"R": site.mesh[0], "C": site.mesh[1], "c": site.local_out()[1]}  # c: channels on this rank

    def steps(self, site, v, exact):
        size = kernels.norm_stat_size(site.val(0).dtype)
        fwd, bwd = conv_norm.BN_STATS
        out = []
        if self.rows:
            calls = [("fwd", k) for k in fwd] + ([("bwd", k) for k in bwd] if site.grads[0] else [])
            out += [(0, phase, all_reduce_bytes(k * size * v["c"], v["R"], exact)) for phase, k in calls]
        if self.cols and self.running:
            out.append((1, "fwd", all_gather_bytes(2 * size, v["C"]) * v["c"]))  # (mean, var) per channel
        return out


@dataclass(frozen=True)
class EmbeddingSpec(KernelSpec):
    """Lookup in a table whose vocab dim is split over mesh axis `vocab_axis`
    (`kernels.VocabSplitEmbedding`): no communication; the result is a partial sum."""

    vocab_axis: int
    name: ClassVar[str] = "embedding"

    def build(self, node, grid, lowering):
        padding_idx = node.args[2] if len(node.args) > 2 else -1
        vocab = node.args[0].meta["val"].shape[0]
        where = f"the embedding table [{vocab}, {node.args[0].meta['val'].shape[1]}]" + (
            f" of module {module_path(node)!r}" if module_path(node) else f" ({node.name})")
        return (kernels.VocabSplitEmbedding(grid, self.vocab_axis, padding_idx, node.name, vocab, where),
                self.operands(node))


@dataclass(frozen=True)
class CrossEntropySpec(KernelSpec):
    """Mean (or, `reduce_sum`, summed) cross-entropy of logits [N, V] with rows over the mesh rows and,
    if `vocab_split`, the vocabulary over the columns (`kernels.VocabParallelCrossEntropy`): the fp32
    max and (sum-exp, target logit) of each row all-reduced in the row, the (loss, tokens, targets out of
    range) triple over
    the column (unless `rows_whole`: a row count the mesh rows do not divide, every row holding all
    of them); backward local."""

    vocab_split: bool
    reduce_sum: bool
    rows_whole: bool = False
    name: ClassVar[str] = "cross_entropy"

    def build(self, node, grid, lowering):
        ignore = node.args[4] if len(node.args) > 4 else node.kwargs.get("ignore_index", -100)
        vocab = node.args[0].meta["val"].shape[1]
        where = f"the cross-entropy over {vocab} classes" + (
            f" in module {module_path(node)!r}" if module_path(node) else f" ({node.name})")
        module = kernels.VocabParallelCrossEntropy(grid, ignore, node.name, self.vocab_split, self.reduce_sum,
                                                   self.rows_whole, vocab, where)
        return module, self.operands(node)

    def describe(self, site):
        return "all-reduce max, sum-exp, target (row); mean (col)" if self.vocab_split else "all-reduce mean (col)"

    def values(self, site):
        if not self.vocab_split:
            return {"R": site.mesh[0]}
        return {"R": site.mesh[0], "C": site.mesh[1], "r": site.local(0)[0]}  # r: rows of logits on this rank

    def steps(self, site, v, exact):
        out = []
        if self.vocab_split:  # fp32 max [r], then (sum-exp, target) [2, r]
            out += [(1, "fwd", all_reduce_bytes(4 * v["r"], v["C"], exact)),
                    (1, "fwd", all_reduce_bytes(8 * v["r"], v["C"], exact))]
        # fp32 (loss, tokens, targets out of range)
        return out if self.rows_whole else out + [(0, "fwd", all_reduce_bytes(12, v["R"], exact))]
