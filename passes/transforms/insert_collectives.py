"""Collective insertion: make every input arrive in the layout its rule asked for, and swap the ops
that need communication for their sharded kernels.

Requires `node.meta[LAYOUT]` and `node.meta[STRATEGY]` from `propagate` (the keys are `passes.meta`'s).
For each consumer it inserts, as call_module nodes on the GraphModule:

- `Redistribute(src -> dst)` where an input's layout differs from the one required (one per distinct
  (input, layout) pair, shared by the consumers that need it, except across the boundary of a
  `no_grad` region: see `passes.capture.regions`);
- `GradSync(axes)` where an input stays replicated over a mesh axis that the consumer's output is
  split (or partial) over: each rank's backward then holds only its block's share of that input's
  gradient, and the all-reduce makes it whole (a LayerNorm weight, a bias, a position embedding);
- a kernel module (SUMMA, sharded norm, vocab-split embedding, vocab-parallel cross-entropy) in place
  of the aten call, when the rule named one (`Strategy.kernel`, a `passes.kernels.spec.KernelSpec`).

A GradSync over an axis that the Redistribute before it gathers (Shard -> Replicate) is folded into
that gather when every user of the gathered tensor syncs that axis: all-gather forward, reduce-scatter
backward (`comm.GatherSum`) instead of an all-reduce of the whole gradient and a cut of this rank's
block: half the backward bytes. This is Megatron's sequence parallelism: with 1D splits the residual
stream stays split over the sequence between a row-split matmul's reduce-scatter and the next
column-split matmul's all-gather, in both directions (`fold_gradsyncs`). A reshape between the two
(GPT-2's Conv1D multiplies a [b*s, h] view of the gathered [b, s, h]) does not stop the fold: the
GradSync moves before the reshape (an all-reduce of the gradient commutes with a reshape), where the
gather's fold finds it (`hoist_gradsyncs`; `hoisted_axes` says where, for the estimate too).

Each module is built by its spec, which every new node carries in `KERNEL` (what `explain` and
`passes.cost.planned` ask), with `LAYOUT`; Redistribute and GradSync nodes are marked `INSERTED`; kernels keep
the replaced node's name, meta and strategy.
"""

from __future__ import annotations

import dataclasses

import torch
from torch.distributed.tensor import Replicate
from torch.fx import GraphModule, Node

from passes.cost.planned import redistribution
from passes.kernels.spec import GradSyncSpec, RedistributeSpec
from passes.layout import Layout
from passes.mesh import Grid
from passes.meta import INSERTED, KERNEL, LAYOUT, REGION, STRATEGY
from passes.rules.moe.routing import grad_summed


def gradsync_axes(consumer: Node, out_layout, inp: Node, need: Layout) -> tuple:
    """The mesh axes over which `inp`, arriving as `need`, stays replicated while `consumer`'s output
    (laid out `out_layout`) is split or partial: its gradient must be all-reduced over them."""
    v = inp.meta.get("val")
    if consumer.op == "output" or not (isinstance(v, torch.Tensor) and v.dtype.is_floating_point):
        return ()
    if grad_summed(inp):  # the expert dispatch sums its gradient over the columns itself
        return ()
    lays = out_layout if isinstance(out_layout, tuple) else (out_layout,)
    split = {a for lay in lays if isinstance(lay, Layout) for a in range(2) if not isinstance(lay[a], Replicate)}
    return tuple(a for a in sorted(split) if isinstance(need[a], Replicate))


def _add_module(gm: GraphModule, before: Node, name: str, spec, built: tuple, layout) -> Node:
    module, (arg,) = built
    name = name.replace(".", "_")
    gm.add_submodule(name, module)
    with gm.graph.inserting_before(before):
        new = gm.graph.call_module(name, (arg,))
    new.meta.update({"val": arg.meta.get("val"), LAYOUT: layout, INSERTED: True, KERNEL: spec,
                     "nn_module_stack": before.meta.get("nn_module_stack", {})})  # explain groups it with its consumer
    return new


def insert_collectives(gm: GraphModule, grid: Grid, *, lowering: str) -> GraphModule:
    """The pass on `gm` for this rank of `grid`: a SUMMA or 3D product runs the lowering marked on its node
    (`passes.meta.LOWERING`), else `lowering` ('broadcast', 'allgather' or 'ring'; never 'auto')."""
    cache: dict = {}
    replaced: dict = {}  # node swapped for a kernel -> its kernel node
    for node in list(gm.graph.nodes):
        strat = node.meta.get(STRATEGY)
        if strat is None or node.meta.get(INSERTED):
            continue
        routed = {}
        # a collective made inside a no_grad region carries no gradient: never share it with one outside
        region = node.meta.get(REGION)
        for inp, need in strat.inputs.items():
            inp = replaced.get(inp, inp)
            have = inp.meta[LAYOUT]
            new = inp
            if have != need:
                key = (inp, need, region)
                if key not in cache:
                    redist = RedistributeSpec(have, need, f"{inp.name}->{node.name}")
                    cache[key] = _add_module(gm, node, f"autopar_{redist.name}_{inp.name}_{len(cache)}", redist,
                                             redist.build(inp, grid, lowering), need)
                new = cache[key]
            sync = gradsync_axes(node, node.meta.get(LAYOUT), inp, need)
            if sync:
                sync_key = (inp, need, sync, region)
                if sync_key not in cache:
                    gsync = GradSyncSpec(sync, f"gradsync:{inp.name}")
                    cache[sync_key] = _add_module(gm, node, f"autopar_{gsync.name}_{inp.name}_{len(cache)}", gsync,
                                                  gsync.build(new, grid, lowering), need)
                new = cache[sync_key]
            if new is not inp:
                node.replace_input_with(inp, new)
                routed[inp] = new
        spec = strat.kernel
        if spec is not None:
            module, args = spec.build(node, grid, lowering)
            args = tuple(routed.get(replaced.get(a, a), replaced.get(a, a)) if isinstance(a, Node) else a
                         for a in args)
            name = f"autopar_{spec.name}_{node.name}"
            gm.add_submodule(name, module)
            with gm.graph.inserting_before(node):
                new = gm.graph.call_module(name, args)
            new.meta.update(node.meta)
            new.meta[KERNEL] = spec
            node.replace_all_uses_with(new)
            gm.graph.erase_node(node)
            new.name = node.name
            replaced[node] = new
    hoist_gradsyncs(gm)
    fold_gradsyncs(gm, grid, lowering)
    gm.graph.lint()
    gm.recompile()
    return gm


RESHAPES = {torch.ops.aten.view.default, torch.ops.aten.reshape.default, torch.ops.aten._unsafe_view.default,
            torch.ops.aten.flatten.using_ints, torch.ops.aten.unflatten.int}


def hoisted_axes(view: Node, sync: tuple, have: Layout | None, need: Layout | None) -> tuple:
    """The axes of `sync` (a GradSync on reshape `view`, its only user's input) that fold into the
    gather of the Redistribute(have -> need) feeding `view`: those it gathers from a plain split.
    () when `view` is no reshape, has other users, or nothing before it gathers."""
    if view.op != "call_function" or view.target not in RESHAPES or len(view.users) != 1 or not sync:
        return ()
    if not (isinstance(have, Layout) and isinstance(need, Layout)) or have == need:
        return ()
    return foldable_axes(have, need, sync)


def planned_hoist(view: Node, layouts: dict) -> tuple:
    """What `hoist_gradsyncs` will do for reshape `view`, read off the propagated strategies before any
    insertion (the estimate's view of it): the axes its only user's GradSync moves before it and folds
    into the gather of `view`'s input, or ()."""
    if view.op != "call_function" or view.target not in RESHAPES or len(view.users) != 1:
        return ()
    user, strat = next(iter(view.users)), view.meta.get(STRATEGY)
    ustrat = user.meta.get(STRATEGY)
    x = view.args[0] if view.args else None
    if strat is None or ustrat is None or not isinstance(x, Node) or x not in strat.inputs:
        return ()
    need = ustrat.inputs.get(view)
    if need is None or layouts.get(view) != need:
        return ()
    sync = gradsync_axes(user, ustrat.output, view, need)
    need_x = strat.inputs[x]
    sharing = [u for u in x.users if getattr(u.meta.get(STRATEGY), "inputs", {}).get(x) == need_x]
    if len(sharing) != 1:  # the gather is shared with another consumer: its GradSync stays
        return ()
    axes = hoisted_axes(view, sync, layouts.get(x), need_x)
    return axes if axes == tuple(sync) else ()


def hoist_gradsyncs(gm: GraphModule) -> None:
    """Move each GradSync on a reshape of a Redistribute's result before the reshape, over the axes the
    Redistribute gathers (`hoisted_axes`), so that `fold_gradsyncs` folds it into the gather."""
    for node in list(gm.graph.nodes):
        spec = node.meta.get(KERNEL)
        if node.op != "call_module" or not isinstance(spec, GradSyncSpec):
            continue
        view = node.args[0]
        if not (isinstance(view, Node) and view.op == "call_function" and view.args):
            continue
        redist = view.args[0]
        if not (isinstance(redist, Node) and redist.op == "call_module") or len(redist.users) != 1:
            continue
        rspec = redist.meta.get(KERNEL)
        if not isinstance(rspec, RedistributeSpec):
            continue
        if hoisted_axes(view, spec.axes, rspec.src, rspec.dst) != tuple(spec.axes):
            continue
        for u in list(node.users):
            u.replace_input_with(node, view)
        node.args = (redist,)
        view.args = (node, *view.args[1:])
        view.prepend(node)
        node.meta["val"], node.meta[LAYOUT] = redist.meta.get("val"), redist.meta.get(LAYOUT)


def foldable_axes(src: Layout, dst: Layout, sync: tuple) -> tuple:
    """The axes of `sync` over which `Redistribute(src -> dst)` gathers a plain split (Shard, not
    Strided): a GradSync over them folds into the gather (`comm.GatherSum`)."""
    return tuple(a for kind, a, _, k, _ in redistribution(src, dst) if kind == "gather" and k == 1 and a in sync)


def fold_gradsyncs(gm: GraphModule, grid: Grid, lowering: str) -> None:
    """Fold each GradSync into the gather of the Redistribute it reads, over the axes that every user of
    that Redistribute syncs (see the module docstring); a GradSync left with no axis is removed."""
    for node in list(gm.graph.nodes):
        spec = node.meta.get(KERNEL)
        if node.op != "call_module" or not isinstance(spec, RedistributeSpec) or not node.users:
            continue
        users = list(node.users)
        if not all(isinstance(u.meta.get(KERNEL), GradSyncSpec) for u in users):
            continue
        common = set.intersection(*(set(u.meta[KERNEL].axes) for u in users))
        axes = foldable_axes(spec.src, spec.dst, tuple(sorted(common)))
        if not axes:
            continue
        folded = dataclasses.replace(spec, synced=tuple(sorted(set(spec.synced) | set(axes))))
        node.meta[KERNEL] = folded
        gm.add_submodule(node.target, folded.build(node.args[0], grid, lowering)[0])
        for u in users:
            left = tuple(a for a in u.meta[KERNEL].axes if a not in axes)
            if not left:
                u.replace_all_uses_with(node)
                gm.graph.erase_node(u)
                gm.delete_submodule(u.target)
                continue
            u.meta[KERNEL] = dataclasses.replace(u.meta[KERNEL], axes=left)
            gm.add_submodule(u.target, u.meta[KERNEL].build(node, grid, lowering)[0])
