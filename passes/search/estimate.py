"""Estimated step time and memory of a propagated graph on one rank: the pricing `strategy` searches with.

Each node is priced from its rule's Strategy and its inputs' layouts, as the insertion pass would
rewrite it: a Redistribute per (input, layout) pair needed (shared by the consumers that need it), a
GradSync where a replicated input feeds split work, a kernel's own collectives. Each is asked of its
spec (`passes.kernels.spec`): the steps `explain` prints as formulas, evaluated on numbers, so the bytes
equal what `explain` and the collective layer count, and the FLOPs `explain` counts. An alpha-beta
model per mesh axis turns them into time: a collective costs alpha + bytes/beta, a matmul flops/F;
SUMMA's broadcast lowering overlaps its next broadcast with the current matmul, so it is charged
calls*alpha + max(bytes/beta, flops/F) + min(bytes/beta, flops/F)/S for its S panels (the first
panel's transfer and the last one's matmul run alone; in general the rest's sum less the share
`CostModel.hidden` of the shorter: `double_buffered`; overlap=False prices with nothing hidden), the all-gather
lowering calls*alpha +
bytes/beta + flops/F less what the weight gradient's reduction hides behind the input gradient's
matmul in backward (`hidden_dw_reduction`; calls: the spec's launches). A 3D linear's depth products choose between the
same two the same way (`_cube`). The ring lowering, priced only where asked for,
as the broadcast lowering with its point-to-point batches as the calls. Memory: the parameter blocks held, and every
intermediate that needs a gradient (an upper bound on what autograd saves).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from passes.transforms.insert_collectives import foldable_axes, gradsync_axes, planned_hoist
from passes.kernels.cube import CubeSpec
from passes.kernels.spec import MATMULS, GradSyncSpec, RedistributeSpec, Site, SummaSpec, flops
from passes.layout import Layout, local_shape, mesh_shape
from passes.cost.model import CostModel
from passes.meta import ROLE, STRATEGY
from passes.transforms.propagate import rule_key

__all__ = ["MATMULS", "CostModel", "Estimate", "double_buffered", "hidden_dw_reduction", "price"]


@dataclass
class Estimate:
    time_s: float = 0.0
    bytes_per_axis: list = field(default_factory=lambda: [0.0, 0.0])
    param_bytes: float = 0.0
    frozen_param_bytes: float = 0.0  # of param_bytes, those of parameters that get no gradient
    activation_bytes: float = 0.0
    memory_bytes: float = 0.0
    lowerings: dict = field(default_factory=dict)  # SUMMA node name -> lowering
    recomputed: tuple = ()  # the repeated blocks whose recomputation time_s and memory_bytes include

    def add(self, other: "Estimate", k: float) -> None:
        self.time_s += k * other.time_s
        for a in range(2):
            self.bytes_per_axis[a] += k * other.bytes_per_axis[a]
        self.param_bytes += k * other.param_bytes
        self.frozen_param_bytes += k * other.frozen_param_bytes
        self.activation_bytes += k * other.activation_bytes
        self.lowerings.update(other.lowerings)


def _local_elems(v, lay, mesh) -> int:
    return math.prod(local_shape(tuple(v.shape), lay, mesh, at=(0, 0)))


def siblings(node, mesh) -> int:
    """How many products share the collective calls of SUMMA node `node` in the all-gather lowering:
    its AB siblings on the same x (itself included) that `passes.transforms.group_siblings` groups; else 1."""
    spec = getattr(node.meta.get(STRATEGY), "kernel", None)
    if not isinstance(spec, SummaSpec):
        return 1
    inp = spec.x

    def groupable(s) -> bool:
        return isinstance(s, SummaSpec) and not s.transposed and not s.rows_whole and s.x is inp

    x, (R, C) = inp.meta.get("val"), mesh_shape(mesh)
    if not groupable(spec) or not isinstance(x, torch.Tensor) or x.shape[-1] % R or x.shape[-1] % C:
        return 1  # K in torch.chunk blocks: not grouped
    return sum(1 for u in inp.users if groupable(getattr(u.meta.get(STRATEGY), "kernel", None)))


def _summa(spec: SummaSpec, site: Site, cm: CostModel, fixed: str | None = None) -> Estimate:
    """One SUMMA node (forward and the backward products that run), with the faster lowering (or the
    `fixed` one). In the
    all-gather lowering k `siblings` share their calls and x's bytes (axis 1): each is charged 1/k."""
    mesh = site.mesh
    per_axis, products = spec.axis_bytes(site), spec.products(site)
    compute = spec.flops(site) / cm.flops
    k = {"broadcast": 1, "allgather": siblings(site.node, mesh)} | ({"ring": 1} if fixed == "ring" else {})
    bw = {lo: sum(per_axis[a] / cm.beta[a] / (k[lo] if a == 1 else 1) for a in range(2) if mesh[a] > 1) * products
          for lo in k}
    lat = {lo: sum(cm.alpha[a] * spec.launches(site, lo) for a in range(2) if mesh[a] > 1) * products / k[lo]
           for lo in k}
    steps = spec.launches(site, "broadcast")  # a product's panels (R + C - gcd(R, C))
    times = {"broadcast": lat["broadcast"] + double_buffered(bw["broadcast"], compute, cm, steps),
             "allgather": lat["allgather"] + bw["allgather"] + compute - hidden_dw_reduction(spec, site, cm)}
    if fixed == "ring":  # priced as the broadcast lowering, with its point-to-point batches as the calls
        times["ring"] = lat["ring"] + double_buffered(bw["ring"], compute, cm, steps)
    lowering = fixed or min(times, key=times.__getitem__)
    return Estimate(time_s=times[lowering], bytes_per_axis=[b * products / (k[lowering] if a == 1 else 1)
                                                            for a, b in enumerate(per_axis)],
                    lowerings={site.node.name: lowering})


def _cube(spec: CubeSpec, site: Site, cm: CostModel, fixed: str | None = None) -> Estimate:
    """One 3D linear with its depth products in the faster lowering (or the `fixed` one): its
    collectives as `CubeSpec.lowering_terms` lists them, the broadcast lowering's transfers overlapped
    with the matmuls (max of the two), the all-gather lowering's added to them, as for SUMMA. The depth
    reduce-scatter and all-gather are the same under both."""
    compute = spec.flops(site) / cm.flops
    times, moved = {}, {}
    for lo in ((fixed,) if fixed else ("broadcast", "allgather")):
        terms = spec.lowering_terms(site, lo)
        lat = sum(cm.alpha[a] * calls for a, _, calls in terms)
        bw = sum(b / cm.beta[a] for a, b, _ in terms)
        steps = site.mesh[0]  # the depth grid's q x q products: q panels each
        times[lo] = lat + (double_buffered(bw, compute, cm, steps) if lo != "allgather" else bw + compute)
        moved[lo] = [sum(b for a, b, _ in terms if a == axis) for axis in range(2)]
    lowering = min(times, key=times.__getitem__)
    return Estimate(time_s=times[lowering], bytes_per_axis=moved[lowering], lowerings={site.node.name: lowering})


def double_buffered(transfer_s: float, compute_s: float, cm: CostModel, steps: float = 1) -> float:
    """Seconds of `steps` panels' transfers and matmuls run double-buffered (the transfer of panel i + 1
    beside the matmul of panel i): the first panel's transfer and the last one's matmul alone, and for
    the rest both, less the share `cm.hidden` of the shorter that the other hides. With even panels,
    (t + c)/steps + (steps - 1)/steps (t + c - hidden min(t, c)): t + c when nothing is hidden (as
    overlap=False prices, with hidden 0), max(t, c) + min(t, c)/steps when all is.

    >>> from dataclasses import replace
    >>> cm = CostModel(alpha=(0.0, 0.0), beta=(1.0, 1.0), flops=1.0)
    >>> double_buffered(4.0, 2.0, cm, steps=2), double_buffered(4.0, 2.0, replace(cm, hidden=0.0), steps=2)
    (5.0, 6.0)
    """
    rest = (steps - 1) / steps
    return (transfer_s + compute_s) * (1 - rest) + rest * (transfer_s + compute_s - cm.hidden * min(transfer_s,
                                                                                                   compute_s))


def hidden_dw_reduction(spec: SummaSpec, site: Site, cm: CostModel) -> float:
    """Seconds of the all-gather lowering's backward that the weight gradient's reduction hides behind
    the input gradient's product (`passes.ops.overlap`): its reduce-scatter over the rows runs during
    dX's matmul, min(its transfer time, that matmul's), charged once. Its link is the one dX's own
    gather over the rows uses, so only the matmul is counted as cover. 0 unless both backward products
    run and the rows sum dW. The broadcast lowering's price already overlaps each product's
    collectives with its matmuls (max of the two), so nothing more is taken off there."""
    if not (site.grads[0] and site.grads[1]) or spec.rows_whole or site.mesh[0] == 1:
        return 0.0
    reduce_s = spec.axis_bytes(site)[0] / cm.beta[0]  # dW's reduce-scatter: axis-0 bytes of one product
    return cm.hidden * min(reduce_s, spec.flops(site) / spec.products(site) / cm.flops)


@dataclass
class _NodeCost:
    shared: list  # (key, terms): collectives a later consumer may share (one Redistribute per (input, layout))
    terms: list  # (axis, bytes, calls) of the node's own kernel
    summa: Estimate | None  # a SUMMA or 3D node's time, bytes and lowering
    compute_s: float
    params: list  # (parameter node, bytes held)
    activation_bytes: float


def _node_cost(node, strat, layouts, mesh, grads, cm, lowering=None) -> _NodeCost:
    shared: list[tuple[tuple, list]] = []  # ((input, layout) or (input, layout, axes), terms)
    params = []
    hoisted = planned_hoist(node, layouts)  # a reshape whose user's GradSync folds into its input's gather
    for inp, need in strat.inputs.items():
        have, v = layouts.get(inp), inp.meta.get("val")
        if not isinstance(v, torch.Tensor) or not isinstance(have, Layout):
            continue
        sync = tuple(a for a in gradsync_axes(node, strat.output, inp, need) if mesh[a] > 1)
        moved_up = planned_hoist(inp, layouts) if have == need else ()
        sync = tuple(a for a in sync if a not in moved_up)  # folded into the gather before the reshape `inp`
        if hoisted and inp is node.args[0]:
            sync = tuple(sorted(set(sync) | {a for a in hoisted if mesh[a] > 1}))
        folded = foldable_axes(have, need, sync) if have != need else ()  # as insert_collectives folds them
        if have != need:
            moved = Site(inp, (inp,), (have,), need, mesh, (inp in grads,))
            shared.append(((inp, need), RedistributeSpec(have, need, synced=folded).terms(moved)))
        sync = tuple(a for a in sync if a not in folded)
        if sync:
            synced = Site(inp, (inp,), (need,), need, mesh, (inp in grads,))
            shared.append(((inp, need, sync), GradSyncSpec(sync).terms(synced)))
        if inp.op == "placeholder" and inp.meta.get(ROLE) == "param":
            params.append((inp, _local_elems(v, have, mesh) * v.element_size()))
    spec, site = strat.kernel, Site.planned(node, strat, layouts, mesh, grads)
    summa = _summa(spec, site, cm, lowering) if isinstance(spec, SummaSpec) else \
        _cube(spec, site, cm, lowering) if isinstance(spec, CubeSpec) else None
    terms = spec.terms(site) if spec is not None and summa is None else []
    act, v = 0.0, node.meta.get("val")
    if node in grads and isinstance(v, torch.Tensor) and isinstance(strat.output, Layout):
        act = _local_elems(v, strat.output, mesh) * v.element_size()
    compute = flops(site, spec) / cm.flops if summa is None else 0.0
    return _NodeCost(shared, terms, summa, compute, params, act)


def price(nodes, layouts: dict, mesh, grads: set, cm: CostModel, params_seen: set | None = None,
          cache: dict | None = None, lowering: str | None = None) -> Estimate:
    """Estimated time, bytes and memory of `nodes` (already propagated) on one rank; a parameter in
    `params_seen` is not counted again (a tied table used before and after the blocks). `cache` keeps
    each node's costs under the key of its rule's result (`propagate.rule_key`), so one cache serves
    one `lowering` (None: each SUMMA product at its faster lowering). An empty `grads` prices a forward
    alone: no backward products, no gradient reductions, nothing saved."""
    est, seen = Estimate(), set()
    params_seen = set() if params_seen is None else params_seen
    for node in nodes:
        strat = node.meta.get(STRATEGY)
        if node.op == "placeholder" or strat is None:
            continue
        nc: _NodeCost | None
        if cache is None:
            nc = _node_cost(node, strat, layouts, mesh, grads, cm, lowering)
        else:
            key = (rule_key(node, layouts), siblings(node, mesh), planned_hoist(node, layouts),
                   tuple(planned_hoist(i, layouts) for i in node.all_input_nodes))
            nc = cache.get(key)
            if nc is None:
                nc = cache[key] = _node_cost(node, strat, layouts, mesh, grads, cm, lowering)
        terms = list(nc.terms)
        for key, ts in nc.shared:
            if key not in seen:
                seen.add(key)
                terms += ts
        if nc.summa is not None:
            est.add(nc.summa, 1)
        for a, nbytes, calls in terms:
            est.time_s += cm.collective(a, nbytes, calls)
            est.bytes_per_axis[a] += nbytes
        est.time_s += nc.compute_s
        for p, nbytes in nc.params:
            if p not in params_seen:
                params_seen.add(p)
                est.param_bytes += nbytes
                if p not in grads and grads:  # frozen: no gradient, no optimizer state (a forward: grads empty)
                    est.frozen_param_bytes += nbytes
        est.activation_bytes += nc.activation_bytes
    return est
