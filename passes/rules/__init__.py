"""Per-op sharding rules: one pure function per op family, registered on aten overloads.

A rule sees a node and the current layouts of its input nodes and returns a `Strategy`: the layout
each tensor input must arrive in, the layout of each output, and optionally a `kernel` (a typed
`passes.kernelspec.KernelSpec` of the runtime module that replaces the aten call on every rank). It
never edits the graph; mismatches between what an input has and what the rule needs become
collectives in `insert_collectives`.

An input layout of `None` is an unplaced parameter: the first rule that consumes it decides its
placement by asking for a layout (see `propagate`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.fx import Node

from passes.kernelspec import KernelSpec
from passes.layout import Layout

RULES: dict = {}


@dataclass
class Strategy:
    inputs: dict[Node, Layout]  # the layout each input must arrive in
    output: Layout | tuple[Layout, ...]  # a tuple for ops returning several tensors
    kernel: KernelSpec | None = None  # the module run instead of the aten op
    note: str = ""  # shown by explain, e.g. "SUMMA AB"
    fallback: bool = False


class Unsupported(Exception):
    """Raised by a rule for a case it does not shard; the node falls back to replication."""


def register(*ops):
    """Register a rule for aten overloads (an OpOverloadPacket registers all its overloads)."""

    def deco(fn):
        for op in ops:
            targets = [getattr(op, o) for o in op.overloads()] if isinstance(op, torch._ops.OpOverloadPacket) else [op]
            for t in targets:
                if t in RULES:
                    raise RuntimeError(f"two sharding rules for {t}: {RULES[t].__name__} and {fn.__name__}")
                RULES[t] = fn
        return fn

    return deco


def val(node) -> object:
    return node.meta.get("val") if isinstance(node, Node) else None


def shape(node) -> tuple:
    return tuple(val(node).shape)


def is_tensor(node) -> bool:
    return isinstance(node, Node) and isinstance(val(node), torch.Tensor)


def is_tensors(node) -> bool:
    """A multi-output op's result (split, chunk, unbind, ...): a getitem takes one piece of it."""
    v = val(node) if isinstance(node, Node) else None
    return isinstance(v, (tuple, list)) and any(isinstance(t, torch.Tensor) for t in v)


def tensor_inputs(node: Node) -> list:
    return [n for n in node.all_input_nodes if is_tensor(n) or is_tensors(n)]


def lookup(target):
    return RULES.get(target)


# importing the families registers their rules
from passes.rules import (attention, conv_inplace, embedding_loss, fallback, matmul, norms,  # noqa: E402,F401
                          pointwise, views)
