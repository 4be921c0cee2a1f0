"""What a fixed strategy's plan leaves in place, per rank, beyond the bytes its collectives move: the
values that cross a pipeline stage boundary (`boundary_bytes`) and the copies its products keep for
backward in another layout than their inputs are made in (`consumed_saved_bytes`). What
`autopar.estimate` adds to the profile's counts, both checked against `autopar.dry_run`."""

from __future__ import annotations

import math

import torch
from torch.fx import GraphModule

from passes.cost.profile import LINEAR
from passes.layout import Partial, local_shape
from passes.meta import ROLE, STRATEGY
from passes.nodes import block_of
from passes.options import Options
from passes.search.strategy import fixed_layouts

__all__ = ["boundary_bytes", "consumed_saved_bytes"]


def boundary_bytes(gm: GraphModule, mesh, strategy: str, block: str, options: Options | None = None) -> tuple:
    """(forward, backward) bytes per rank that cross into repeated block `block` from before it under one fixed
    `strategy` on `mesh` -- each value the block reads from outside (its hidden state, an attention mask,
    rotary tables; parameters aside) in the layout its producer leaves it (a partial sum reduce-scattered
    over its axes), and the gradients of those that need one: what a pipeline stage boundary before this
    block sends each way per micro-batch."""
    ev, layouts = fixed_layouts(gm, mesh, strategy, options)
    nodes = list(gm.graph.nodes)
    inside = {n for n in nodes if block_of(n) == block}
    crossing = {a for n in inside for a in n.all_input_nodes
                if a not in inside and a.op != "get_attr" and a.meta.get(ROLE) not in ("param", "buffer")}
    fwd = bwd = 0
    for a in crossing:
        v = a.meta.get("val")
        if not isinstance(v, torch.Tensor):
            continue
        lay = layouts.get(a)
        shape = local_shape(tuple(v.shape), lay, ev.mesh, at=(0, 0)) if lay is not None else tuple(v.shape)
        nbytes = math.prod(shape) * v.element_size()
        if lay is not None and lay.has_partial:  # a stage's output is never left partial: reduce-scattered
            nbytes //= math.prod(n for axis, n in enumerate(ev.mesh) if isinstance(lay[axis], Partial))
        fwd += nbytes
        bwd += nbytes if a in ev.grads else 0
    return fwd, bwd


def consumed_saved_bytes(gm: GraphModule, mesh, strategy: str, block: str | None) -> float:
    """Bytes per rank that the products of repeated block `block` (None: of everything outside the blocks)
    keep for backward beyond what their inputs hold in the plan's layouts, under one fixed `strategy` on
    `mesh`: a product that reads its activation input in another layout than it is made in (1D's column-
    parallel linear reads the whole sequence, all-gathered) saves that copy. Each (input, layout) once."""
    ev, layouts = fixed_layouts(gm, mesh, strategy)
    nodes = list(gm.graph.nodes)
    extra, seen = 0.0, set()
    for node in nodes:
        strat = node.meta.get(STRATEGY)
        if str(node.target) not in LINEAR or strat is None or block_of(node) != block:
            continue
        for inp, need in strat.inputs.items():
            have, v = layouts.get(inp), inp.meta.get("val")
            if (inp.meta.get(ROLE) == "param" or not isinstance(v, torch.Tensor) or have is None or have == need
                    or (inp, need) in seen):
                continue
            seen.add((inp, need))
            size = v.element_size()
            extra += (math.prod(local_shape(tuple(v.shape), need, ev.mesh, at=(0, 0)))
                      - math.prod(local_shape(tuple(v.shape), have, ev.mesh, at=(0, 0)))) * size
    return max(extra, 0.0)
