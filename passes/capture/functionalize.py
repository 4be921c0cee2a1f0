"""Functionalize in-place ops on intermediate tensors: `x.add_(y)` becomes `x2 = x + y`, and every
later use of `x` (and of the in-place op's result) reads `x2`.

Unmodified model code writes `embeddings += position_embeddings` or `inputs_embeds *= sqrt(d)` on a
tensor it just computed. Split 2D, such a tensor is often a partial sum (a vocab-split embedding
lookup, a row-split matmul) that no rank holds whole, so it cannot be updated in place; out of place,
the ordinary rules handle it (a sum of partial sums stays partial, a scale of one is reduced first).

An op is rewritten only when that changes nothing observable: its first argument does not share
storage with a graph input (a parameter, buffer or user input keeps its in-place update: the update is
the point), and no other tensor sharing that storage (a view it was taken from, a view taken from it)
is read after the op. Aliasing is derived from the op schemas' alias annotations of the current graph.
The out-of-place result is cast back to the argument's dtype when type promotion would widen it
(an in-place op keeps its argument's dtype). Requires `node.meta["val"]`; the new nodes carry the
replaced node's meta with a fresh `val`.

>>> import torch
>>> class M(torch.nn.Module):
...     def forward(self, x):
...         y = x * 2
...         y += 1
...         return y
>>> gm = functionalize(torch.export.export(M(), (torch.randn(2),), strict=False).graph_module)
>>> [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
['aten.mul.Tensor', 'aten.add.Tensor']
"""

from __future__ import annotations

import operator

import torch
from torch.fx import GraphModule, Node

from passes.compat import OpOverload, set_version_counter
from passes.meta import REGION, ROLE

aten = torch.ops.aten


def _alias_arg(node: Node):
    """The argument node whose storage `node`'s result shares (a view, an in-place op, a getitem of
    a split), else None."""
    if node.op != "call_function":
        return None
    if node.target is operator.getitem:
        return node.args[0]
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return None
    sets = {a for r in schema.returns if r.alias_info is not None for a in r.alias_info.before_set}
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is not None and sets & set(arg.alias_info.before_set):
            value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
            return value if isinstance(value, Node) else None
    return None


def _root(node: Node) -> Node:
    while (src := _alias_arg(node)) is not None:
        node = src
    return node


def _aliases(root: Node) -> set:
    """Every node whose result shares `root`'s storage."""
    seen, todo = {root}, [root]
    while todo:
        for user in todo.pop().users:
            if user not in seen and _alias_arg(user) is not None and _alias_arg(user) in seen:
                seen.add(user)
                todo.append(user)
    return seen


def _functional(op):
    """aten.add_.Tensor -> aten.add.Tensor (or aten.unsqueeze_ -> the view aten.unsqueeze), or None
    when there is no such overload."""
    if not isinstance(op, OpOverload) or op.namespace != "aten":
        return None
    name = op.overloadpacket.__name__
    packet = getattr(aten, name[:-1], None) if name.endswith("_") else None
    if packet is None:
        return None
    out = getattr(packet, op._overloadname, None)
    if out is None:  # named differently (transpose_.default / transpose.int): match the arguments
        sig = [(a.name, str(a.type)) for a in op._schema.arguments]
        out = next((getattr(packet, o) for o in packet.overloads()
                    if [(a.name, str(a.type)) for a in getattr(packet, o)._schema.arguments] == sig), None)
    if out is None or any(a.alias_info is not None and a.alias_info.is_write for a in out._schema.arguments):
        return None
    return out


def _is_view(op) -> bool:
    """A view op: its result aliases its first argument (the out-of-place form of unsqueeze_, t_, ...)."""
    first = op._schema.arguments[0].alias_info
    return first is not None and not first.is_write


def _fake(a):
    return a.meta["val"] if isinstance(a, Node) else a


def _rewrite(gm: GraphModule, node: Node, op, order: dict) -> None:
    target = node.args[0]
    want = target.meta["val"]
    args = torch.fx.node.map_aggregate(node.args, _fake)
    kwargs = torch.fx.node.map_aggregate(node.kwargs, _fake)
    with want.fake_mode:
        got = op(*args, **kwargs)
    meta = {k: v for k, v in node.meta.items() if k != "val"}
    with gm.graph.inserting_before(node):
        new = gm.graph.call_function(op, node.args, node.kwargs)
        new.meta.update(meta, val=got)
        order[new] = order[node]
        if got.dtype != want.dtype:
            with want.fake_mode:
                cast_val = got.to(want.dtype)
            new = gm.graph.call_function(aten.to.dtype, (new, want.dtype))
            new.meta.update(meta, val=cast_val)
            order[new] = order[node]
    for user in list(target.users):
        if order[user] > order[node]:
            user.replace_input_with(target, new)
    node.replace_all_uses_with(new)
    gm.graph.erase_node(node)


def _safe(node: Node, order: dict) -> bool:
    target = node.args[0]
    root = _root(target)
    if root.op != "call_function":  # a graph input, parameter, buffer or constant: keep the update
        return False
    # aliases made from `target` or from the op's result after the op read the new value: rewired too
    rewired = {a for a in _aliases(target) if order[a] > order[node]} | _aliases(node) | {target}
    return not any(order[u] > order[node] for a in _aliases(root) - rewired for u in a.users)


def writes_first_arg(node: Node) -> bool:
    """An in-place op (add_, copy_, masked_fill_, ...): its schema says it writes its first argument."""
    schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
    alias = schema.arguments[0].alias_info if schema is not None and schema.arguments else None
    return bool(alias is not None and alias.is_write) and isinstance(node.args[0], Node)


def functionalize(gm: GraphModule) -> GraphModule:
    """Rewrite the in-place ops it safely can; the others stay, and their readers read the updated
    argument itself (an in-place op returns it), so a parameter updated in place and then used is
    seen by its user's rule as the parameter."""
    order = {n: float(i) for i, n in enumerate(gm.graph.nodes)}
    for node in list(gm.graph.nodes):
        if not writes_first_arg(node):
            continue
        op = _functional(node.target)
        if op is not None and _is_view(op):
            # unsqueeze_, t_, ...: only the tensor object's shape changes, its storage and every other
            # view of it stay as they were; kept for graph inputs, whose callers see the new shape
            if node.args[0].op != "placeholder":
                _rewrite(gm, node, op, order)
            continue  # kept: its readers read its result, whose shape its argument does not have
        if (op is not None and isinstance(node.meta.get("val"), torch.Tensor) and _safe(node, order)
                and tuple(_fake(node.args[0]).shape) == tuple(node.meta["val"].shape)):
            _rewrite(gm, node, op, order)
            continue
        node.replace_all_uses_with(node.args[0])
    gm.graph.lint()
    gm.recompile()
    return gm


@torch.fx.node.has_side_effect
def version_of(t: torch.Tensor) -> int:
    return t._version


@torch.fx.node.has_side_effect
def restore_version(t: torch.Tensor, version: int) -> None:
    set_version_counter((t,), (version,))


def keep_parameter_views(gm: GraphModule) -> GraphModule:
    """An in-place update of a parameter under no_grad (`weight.mul_(0.99)` in forward) must leave
    autograd's view of it intact: each rank's parameter arrives as the view `DTensor.to_local()` makes
    inside an autograd Function, and autograd refuses to differentiate through such a view once its
    version counter moved. The update is applied as eager applies it to a leaf (same storage, not
    recorded), with the version counter put back. Requires `node.meta[ROLE]` on placeholders. (Eager
    would also raise if this forward had saved the parameter for backward before updating it; here
    the backward uses the updated values.)"""
    for node in list(gm.graph.nodes):
        if not writes_first_arg(node):
            continue
        root = _root(node.args[0])
        if root.op != "placeholder" or root.meta.get(ROLE) != "param":
            continue
        with gm.graph.inserting_before(node):
            version = gm.graph.call_function(version_of, (root,))
        with gm.graph.inserting_after(node):
            restore = gm.graph.call_function(restore_version, (root, version))
        for n in (version, restore):
            n.meta.update({k: node.meta[k] for k in ("nn_module_stack", "stack_trace", REGION)
                           if k in node.meta})
    gm.graph.lint()
    gm.recompile()
    return gm
