"""Inline grad-mode and autocast regions: `with torch.no_grad():` (or `enable_grad`, `autocast`) inside
a forward becomes plain nodes of the main graph, bracketed by nodes that switch the mode at run time.

torch.export represents such a region as a higher-order op whose body is a separate GraphModule:
`wrap_with_set_grad_enabled(False, submod, *args)` or `wrap_with_autocast(device, dtype, enabled,
cache, submod, *args)`. Rules are written for aten ops, so the body's nodes are copied into the main
graph where the call was, between

    prev = torch.is_grad_enabled(); torch._C._set_grad_enabled(False)  ...  torch._C._set_grad_enabled(prev)

(or `_enter_autocast` ... `_exit_autocast`). The mode is switched at run time rather than emulated by
detaching, so the region keeps eager semantics exactly: its results do not require grad, an in-place
update of a parameter or buffer is allowed and is not recorded by autograd, and an in-place op returns
the very tensor it updated (a parameter used after `weight.mul_(0.99)` still receives its gradient).
Both functions are side-effectful to torch.fx, so dead-code elimination keeps them.

Adds `node.meta[REGION]` (the name of the call it came from; nested regions join their names
with '/') on every inlined node: collectives are not shared across a region's boundary (a
redistribution made under no_grad carries no gradient). Other higher-order ops (torch.cond, ...) stay
and are refused by `propagate` with the op, module path and source line.

>>> import torch
>>> class M(torch.nn.Module):
...     def forward(self, x):
...         with torch.no_grad():
...             y = x * 2
...         return x + y
>>> ep = torch.export.export(M(), (torch.randn(2),), strict=False)
>>> gm = inline_regions(ep.graph_module)
>>> [n.target.__name__ for n in gm.graph.nodes if n.op == "call_function" and not hasattr(n.target, "_schema")]
['is_grad_enabled', '_set_grad_enabled', '_set_grad_enabled']
"""

from __future__ import annotations

import operator

import torch
from torch.fx import GraphModule, Node

from passes.compat import enter_autocast, exit_autocast, set_grad_enabled
from passes.meta import REGION

_higher = torch.ops.higher_order
INLINED = (_higher.wrap_with_set_grad_enabled, _higher.wrap_with_autocast)


def _body_args(node: Node) -> tuple:
    """(mode arguments, body submodule node, body inputs) of a region call."""
    n_mode = 1 if node.target is _higher.wrap_with_set_grad_enabled else 4
    return node.args[:n_mode], node.args[n_mode], node.args[n_mode + 1:]


def _copy_body(gm: GraphModule, node: Node, body: GraphModule, inputs: tuple, region: str):
    """Copy the body's nodes before `node`; returns what the body's output refers to, remapped."""
    env = dict(zip(body.graph.find_nodes(op="placeholder"), inputs))
    for sub in body.graph.nodes:
        if sub.op == "placeholder":
            continue
        if sub.op == "output":
            return torch.fx.node.map_arg(sub.args[0], env.__getitem__)
        if sub.op == "get_attr":  # a constant of the body: hand it to the main module under a fresh name
            name = f"{region}_{sub.target}".replace(".", "_").replace("/", "_")
            setattr(gm, name, getattr(body, sub.target))
            new = gm.graph.get_attr(name)
            new.meta.update(sub.meta)
        else:
            new = gm.graph.node_copy(sub, env.__getitem__)
        for key in ("nn_module_stack", "stack_trace"):  # the body may lack them: the call has them
            if not new.meta.get(key) and node.meta.get(key):
                new.meta[key] = node.meta[key]
        inner = sub.meta.get(REGION)
        new.meta[REGION] = f"{region}/{inner}" if inner else region
        env[sub] = new
    raise AssertionError(f"region body of {node.name} has no output node")


def _enter(gm: GraphModule, node: Node, mode: tuple):
    """Nodes that switch the mode on; returns a function that adds the nodes switching it back."""
    meta = {k: node.meta[k] for k in ("nn_module_stack", "stack_trace") if k in node.meta}
    if node.target is _higher.wrap_with_set_grad_enabled:
        prev = gm.graph.call_function(torch.is_grad_enabled)
        nodes = [prev, gm.graph.call_function(set_grad_enabled, (mode[0],))]
        exit_ = (set_grad_enabled, prev)
    else:
        ctx = gm.graph.call_function(enter_autocast, mode)
        nodes, exit_ = [ctx], (exit_autocast, ctx)
    for n in nodes:
        n.meta.update(meta)

    def leave():
        gm.graph.call_function(exit_[0], (exit_[1],)).meta.update(meta)

    return leave


def _inline_one(gm: GraphModule, node: Node) -> None:
    mode, body_node, inputs = _body_args(node)
    body = getattr(gm, body_node.target)
    inline_regions(body)  # nested regions first
    with gm.graph.inserting_before(node):
        leave = _enter(gm, node, mode)
        out = _copy_body(gm, node, body, inputs, node.name)
        leave()
    for user in list(node.users):
        if user.op == "call_function" and user.target is operator.getitem and isinstance(out, (tuple, list)):
            user.replace_all_uses_with(out[user.args[1]])
            gm.graph.erase_node(user)
    if node.users:
        node.replace_all_uses_with(out)
    gm.graph.erase_node(node)
    if not body_node.users:
        gm.graph.erase_node(body_node)
        if not any(n.op == "get_attr" and n.target == body_node.target for n in gm.graph.nodes):
            delattr(gm, body_node.target)


def inline_regions(gm: GraphModule) -> GraphModule:
    """Inline every grad-mode and autocast region of `gm` (and of the regions inside them)."""
    calls = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in INLINED]
    for node in calls:
        _inline_one(gm, node)
    if calls:
        gm.graph.lint()
        gm.recompile()
    return gm
