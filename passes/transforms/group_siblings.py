"""Group sibling SUMMA products: linears that read the same activation share their collective calls.

q, k and v (gate and up) of a block multiply one x by their own weights. Under the all-gather lowering
each product makes one call per mesh axis and gathers the same x; `passes.ops.summa_group.SummaGroup`
runs the k products with one call per axis for all of them, x gathered once. Requires the inserted graph
(`insert_collectives`, after `localize`) with `KERNEL` on its SUMMA nodes. For every set of two or
more `kernels.SummaLinear` nodes with the same x, the AB form, the all-gather lowering, no torch.chunk
blocks (`full`), x split over the rows (not `rows_whole`), one weight dtype and the same need for a
weight gradient, it inserts one `SummaGroup` node before the first and turns each member into a
`SummaMember` that picks its output: the members keep their names, arguments and meta, and their
specs say who launches the calls (`SummaSpec.grouped`: "lead", "follow").
"""

from __future__ import annotations

import dataclasses

from torch.fx import GraphModule, Node

from passes.cost.planned import nodes_needing_grad
from passes.meta import KERNEL
from passes.ops.modules import SummaLinear
from passes.ops.summa_group import SummaGroup, SummaMember


def _key(gm: GraphModule, node: Node, grads: set):
    """What siblings share (None: the node is not a product this pass groups)."""
    if node.op != "call_module":
        return None
    m = gm.get_submodule(node.target)
    if not (type(m) is SummaLinear and not m.transposed and m.lowering == "allgather" and not m.rows_whole
            and m.full is None):
        return None
    x, w = node.args[0], node.args[1]
    return x, w.meta["val"].dtype, w in grads


def group_siblings(gm: GraphModule, grid) -> GraphModule:
    grads = nodes_needing_grad(gm)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    sets: dict = {}
    for node in gm.graph.nodes:
        key = _key(gm, node, grads)
        if key is not None:
            sets.setdefault(key, []).append(node)
    for members in sets.values():
        first = members[0]
        if len(members) < 2 or any(order[m.args[1]] > order[first] for m in members):
            continue  # a weight made after the first member (regrouped by a Redistribute): left alone
        _group(gm, members, grid)
    gm.graph.lint()
    gm.recompile()
    return gm


def _group(gm: GraphModule, members: list, grid) -> None:
    first = members[0]
    mods = [gm.get_submodule(m.target) for m in members]
    name = f"autopar_summa_group_{first.name}"
    gm.add_submodule(name, SummaGroup(grid, tuple(m.flip for m in mods), tuple(m.tag for m in mods)))
    with gm.graph.inserting_before(first):
        group = gm.graph.call_module(name, (first.args[0], *(m.args[1] for m in members)))
    group.meta.update({"val": tuple(m.meta.get("val") for m in members),
                       "nn_module_stack": first.meta.get("nn_module_stack", {})})
    for i, m in enumerate(members):
        sub = f"autopar_summa_member_{m.name}"
        gm.add_submodule(sub, SummaMember(i))
        gm.delete_submodule(m.target)
        m.target = sub
        m.kwargs = {**m.kwargs, "group": group}
        m.meta[KERNEL] = dataclasses.replace(m.meta[KERNEL], grouped="lead" if i == 0 else "follow")
