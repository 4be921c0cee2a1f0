"""Per-op sharding rules: one pure function per op family, registered on aten overloads.

A rule sees a node and the current layouts of its input nodes and returns a `Strategy`: the layout
each tensor input must arrive in, the layout of each output, and optionally a `kernel` (a typed
`passes.kernels.spec.KernelSpec` of the runtime module that replaces the aten call on every rank). It
never edits the graph; mismatches between what an input has and what the rule needs become
collectives in `insert_collectives`.

An input layout of `None` is an unplaced parameter: the first rule that consumes it decides its
placement by asking for a layout (see `propagate`).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.fx import Node

from passes.compat import OpOverloadPacket
from passes.kernels.spec import KernelSpec
from passes.layout import REPLICATED, Layout, Partial, Replicate, Shard, split_dim
from passes.nodes import shape
from passes.errors import DuplicateRuleError

RULES: dict = {}
NAMED_RULES: dict = {}  # "namespace.op.overload" -> rule, for ops of libraries loaded later (transformers)


@dataclass
class Strategy:
    inputs: dict[Node, Layout]  # the layout each input must arrive in
    # a tuple for ops returning several tensors; None: no layout of its own (the graph's output node,
    # or a transpose / in-place update of an unplaced parameter, which waits for a consumer to place it)
    output: Layout | tuple[Layout, ...] | None
    kernel: KernelSpec | None = None  # the module run instead of the aten op
    note: str = ""  # shown by explain, e.g. "SUMMA AB"
    fallback: bool = False


class Unsupported(Exception):
    """Raised by a rule for a case it does not shard; the node falls back to replication."""


def register(*ops):
    """Register a rule for aten overloads (an OpOverloadPacket registers all its overloads)."""

    def deco(fn):
        for op in ops:
            targets = [getattr(op, o) for o in op.overloads()] if isinstance(op, OpOverloadPacket) else [op]
            for t in targets:
                if t in RULES:
                    raise DuplicateRuleError(f"two sharding rules for {t}: {RULES[t].__name__} and {fn.__name__}")
                RULES[t] = fn
        return fn

    return deco


def register_named(*names: str):
    """Register a rule for ops named "namespace.op.overload" that a library registers when it is
    imported (transformers' grouped expert matmul): passes never imports that library itself."""

    def deco(fn):
        for name in names:
            if name in NAMED_RULES:
                raise DuplicateRuleError(f"two sharding rules for {name}: {NAMED_RULES[name].__name__} and "
                                         f"{fn.__name__}")
            NAMED_RULES[name] = fn
        return fn

    return deco


def whole_along(layouts: dict, x: Node, dim: int) -> Layout:
    """x's layout (replicated if x is an unplaced parameter) with tensor dim `dim` and any partial axis
    made whole: what an op that mixes values along `dim` (softmax, cat, a slice) needs."""
    lay = (layouts[x] or REPLICATED).normalized(len(shape(x)))
    return Layout(tuple(Replicate() if isinstance(p, Partial) or split_dim(p) == dim else p for p in lay.placements))


def kept_row_split(lay: Layout | None, ndim: int) -> Shard | None:
    """The split over mesh axis 0 (the rows) that a tensor laid out `lay` already has on one of its
    lead dims (any dim but the last), else None: batch-side splits a matmul or norm keeps as they are."""
    if lay is None:
        return None
    p = lay.normalized(ndim)[0]
    return p if isinstance(p, Shard) and p.dim < ndim - 1 else None


def lookup(target):
    rule = RULES.get(target)
    return rule if rule is not None or not NAMED_RULES else NAMED_RULES.get(str(target))
