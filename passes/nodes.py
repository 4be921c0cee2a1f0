"""Reading fx nodes: the example value torch.export recorded, an aten call's arguments by schema
position, the module path and user source line a node came from, and the repeated block it is part
of. Every pass reads nodes through these; none of them edits a graph.
"""

from __future__ import annotations

import os
import re
from typing import Any

import torch
from torch.fx import Node

_TORCH_DIR = os.path.dirname(torch.__file__)


def val(node) -> Any:
    """The example value torch.export recorded for `node` (a fake tensor; a tuple of them for a
    multi-output op; a SymInt or a plain number for size arithmetic); None for a non-node argument."""
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


def arg(node: Node, i: int, name: str, default=None):
    """Argument `i` of an aten call, called `name` in the op's schema: the graph holds it in `args`, or
    in `kwargs` when it was passed by keyword, or nowhere when it has its default."""
    return node.args[i] if len(node.args) > i else node.kwargs.get(name, default)


def module_path(node: Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path, _cls = list(stack.values())[-1]
    return path


def source_line(node: Node) -> str:
    """The innermost line of the node's stack trace outside torch (the user's code), else the last."""
    lines = (node.meta.get("stack_trace") or "").strip().splitlines()
    frames = [(lines[i].strip(), lines[i + 1].strip()) for i in range(len(lines) - 1)
              if lines[i].strip().startswith("File ")]
    user = [f for f in frames if _TORCH_DIR not in f[0] and not f[0].startswith('File "<')]  # not generated code
    pick = (user or frames or [("", "")])[-1]
    return f"{pick[0]}: {pick[1]}" if pick[0] else ""


def block_of(node: Node) -> str | None:
    """The repeated block a node belongs to: its module path up to the first numbered part
    ('model.layers.3' for 'model.layers.3.mlp.up_proj'), None outside numbered modules."""
    return block_path(module_path(node))


def block_path(path: str) -> str | None:
    """The repeated block of a module or parameter path: up to its first numbered part ('model.layers.3'
    for 'model.layers.3.mlp.up_proj.weight'), None without one."""
    m = re.match(r"^(.*?\.\d+)(\.|$)", path)
    return m.group(1) if m else None


def repeated_blocks(paths) -> list:
    """The repeated blocks among module paths (`model.named_modules()`'s names), in order: each path cut at
    its first numbered part (`block_path`, as recompute and FSDP units cut them), from the container
    holding the most ('model.layers' for 'model.layers.0', 'model.layers.1', ...; a block's own numbered
    children, such as its experts, are parts of it, never blocks)."""
    runs: dict[str, dict[str, bool]] = {}
    for path in paths:
        block = block_path(path)
        if block is not None:
            runs.setdefault(block.rpartition(".")[0], {})[block] = True
    return list(runs[max(runs, key=lambda container: len(runs[container]))]) if runs else []
