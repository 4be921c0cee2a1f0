"""The choice units of a captured graph and its repeated blocks: what `passes.search.strategy` assigns
strategies to and what lets its estimate price three blocks for a whole stack.

A unit is the weight matmuls that read the same activation (q|k|v, gate|up, one projection) or one
embedding table; its key names its place with the block index replaced by `*`, so the units at the
same place in repeated blocks share one key (one variable of the search).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch.fx import GraphModule, Node

from passes.meta import ROLE
from passes.nodes import block_of, module_path
from passes.rules.views import TRANSPOSES, VIEWS
from passes.search.estimate import MATMULS

__all__ = ["Unit", "find_units", "repeated_blocks", "OPTIONS", "EMBED_OPTIONS"]

aten = torch.ops.aten
OPTIONS = ("2d", "1d", "rep")
EMBED_OPTIONS = ("2d", "1d")
_THROUGH = {*VIEWS, *TRANSPOSES, aten._to_copy.default, aten.clone.default, aten.alias.default,
            aten.detach.default}


@dataclass
class Unit:
    key: str  # shared by the units at the same place in repeated blocks
    nodes: list
    options: tuple


def _source(n) -> Node:
    """`n` without the views, transposes and copies in front of it."""
    while isinstance(n, Node) and n.op == "call_function" and n.target in _THROUGH:
        n = n.args[0]
    return n


def _param_of(n) -> Node | None:
    n = _source(n)
    return n if isinstance(n, Node) and n.op == "placeholder" and n.meta.get(ROLE) == "param" else None


def _generic(path: str) -> str:
    return re.sub(r"\.\d+(?=\.|$)", ".*", path, count=1)


def find_units(gm: GraphModule) -> list:
    """The choice units of a captured graph, in graph order."""
    groups: dict[Node, Unit] = {}  # a matmul's input (views stripped) -> the unit of matmuls reading it
    tables = set()
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target == aten.embedding.default and _param_of(node.args[0]):
            tables.add(_param_of(node.args[0]))
    units = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target == aten.embedding.default and _param_of(node.args[0]) is not None:
            units.append(Unit("embedding:" + _generic(module_path(node)), [node], EMBED_OPTIONS))
        elif node.target in MATMULS:
            xi, wi = MATMULS[node.target]
            p = _param_of(node.args[wi])
            if p is None or len(p.meta["val"].shape) != 2 or p in tables:  # a tied head follows its table
                continue
            src = _source(node.args[xi])
            if src in groups:
                groups[src].nodes.append(node)
                continue
            groups[src] = Unit("", [node], OPTIONS)
            units.append(groups[src])
    for u in units:
        if not u.key:
            u.key = "matmul:" + "|".join(_generic(module_path(n)) or n.name for n in u.nodes)
    return units


def repeated_blocks(gm: GraphModule) -> list | None:
    """[pre, block 0, block 1, ..., post] node lists when the graph is a run of >= 4 identical blocks
    (same ops in the same order), else None."""
    nodes = list(gm.graph.nodes)
    ids = [block_of(n) if n.op == "call_function" else None for n in nodes]
    first = next((i for i, b in enumerate(ids) if b is not None), None)
    if first is None:
        return None
    last = max(i for i, b in enumerate(ids) if b is not None)
    runs: list[tuple[str | None, list[Node]]] = []  # (block id, its nodes) in graph order
    cur = None
    for i in range(first, last + 1):
        if ids[i] is None or ids[i] != cur:
            if ids[i] is None or any(r[0] == ids[i] for r in runs):
                return None  # something between blocks, or a block that comes back: not a simple chain
            runs.append((ids[i], []))
            cur = ids[i]
        runs[-1][1].append(nodes[i])
    blocks = [r[1] for r in runs]
    if len(blocks) < 4 or any([n.target for n in b] != [n.target for n in blocks[0]] for b in blocks):
        return None
    return [nodes[:first]] + blocks + [nodes[last + 1:]]
