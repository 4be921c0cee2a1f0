"""Choosing how each weight matmul is split: 2D SUMMA, 1D (Megatron column/row) or replicated.

2D moves more bytes than 1D on few devices and fewer on many; small projections may be cheapest
replicated. `choose` picks, per *unit* (the weight matmuls that read the same activation: q|k|v, or
gate|up, or one projection; an embedding table), one of

    2d   SUMMA on the R x C grid (with the lowering that is faster for it)
    1d   over the C columns, batch over the R rows: a column split when the input arrives whole
         over the columns, a row split when it arrives split by in-features (Megatron's pairing)
    rep  the weight whole on every rank (batch split over the rows only)

and returns the assignment with the smallest estimated step time whose per-rank memory fits a
limit. Units at the same place in repeated blocks (`model.layers.3.mlp.up_proj`,
`model.layers.7.mlp.up_proj`) share one variable, so a 48-layer model has as many variables as a
1-layer one; when every variable's options multiply to at most `EXHAUSTIVE` the search enumerates
them all (exact for the model below), otherwise it alternates exact enumeration of the block
variables and of the others until neither changes. The all-2d and all-1d assignments are always
evaluated, so the choice is never estimated slower than the better fixed scheme.

The estimate of an assignment runs the real rules (`propagate_node`) and prices what the insertion
pass would add, per mesh axis, with an alpha-beta model: a collective costs alpha + bytes/beta
(bytes received per rank, `passes.mesh.CommLog` conventions), a matmul flops/F. SUMMA's broadcast
lowering overlaps its next broadcast with the current matmul, so it is charged
calls*alpha + max(bytes/beta, flops/F); the all-gather lowering calls*alpha + bytes/beta + flops/F.
Memory: parameters times (2 + optimizer states) plus every intermediate that needs a gradient (an
upper bound on what autograd saves). With identical blocks the estimate propagates the first three
blocks and the last one stands in for the rest (checked: the third block must see the layouts the
second saw), so its cost does not grow with depth.
"""

from __future__ import annotations

import itertools
import math
import re
import time
from dataclasses import dataclass, field

import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.fx import GraphModule, Node

from passes.cost import nodes_needing_grad
from passes.layout import Layout, local_shape, mesh_shape, parts, split_dim
from passes.propagate import Propagation, module_path, propagate_node

aten = torch.ops.aten
OPTIONS = ("2d", "1d", "rep")
EMBED_OPTIONS = ("2d", "1d")
EXHAUSTIVE = 1024  # assignments enumerated outright; more alternate block / non-block enumeration
_WEIGHT_ARG = {aten.linear.default: (0, 1), aten.addmm.default: (1, 2), aten.mm.default: (0, 1),
               aten.matmul.default: (0, 1)}  # (activation arg, weight arg)
_THROUGH = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.t.default,
            aten.transpose.int, aten.permute.default, aten._to_copy.default, aten.clone.default,
            aten.alias.default, aten.detach.default}


@dataclass
class CostModel:
    """alpha (s per collective) and beta (bytes received per s) per mesh axis, and the matmul rate."""

    alpha: tuple = (2e-5, 1e-5)
    beta: tuple = (25e9, 150e9)
    flops: float = 400e12
    source: str = "default"

    @classmethod
    def from_dict(cls, d: dict) -> "CostModel":
        """From the JSON `autopar calibrate` writes (see autopar/calibrate.py)."""
        axes = d["axes"]
        beta = tuple(float("inf") if a["beta_bytes_per_s"] is None else float(a["beta_bytes_per_s"]) for a in axes)
        return cls(tuple(float(a["alpha_s"]) for a in axes), beta, float(d["flops_per_s"]), d.get("source", "?"))

    def collective(self, axis: int, nbytes: float, calls: int = 1) -> float:
        return calls * self.alpha[axis] + nbytes / self.beta[axis]


@dataclass
class Estimate:
    time_s: float = 0.0
    comm_s: float = 0.0
    compute_s: float = 0.0
    bytes_per_axis: list = field(default_factory=lambda: [0.0, 0.0])
    param_bytes: float = 0.0
    activation_bytes: float = 0.0
    memory_bytes: float = 0.0
    lowerings: dict = field(default_factory=dict)  # SUMMA node name -> lowering

    def add(self, other: "Estimate", k: float) -> None:
        self.time_s += k * other.time_s
        self.comm_s += k * other.comm_s
        self.compute_s += k * other.compute_s
        for a in range(2):
            self.bytes_per_axis[a] += k * other.bytes_per_axis[a]
        self.param_bytes += k * other.param_bytes
        self.activation_bytes += k * other.activation_bytes
        self.lowerings.update(other.lowerings)


@dataclass
class Unit:
    key: str  # shared by the units at the same place in repeated blocks
    nodes: list
    options: tuple


def _param_of(n) -> Node | None:
    while isinstance(n, Node) and n.op == "call_function" and n.target in _THROUGH:
        n = n.args[0]
    return n if isinstance(n, Node) and n.op == "placeholder" and n.meta.get("autopar_role") == "param" else None


def _source(n) -> Node:
    while isinstance(n, Node) and n.op == "call_function" and n.target in _THROUGH:
        n = n.args[0]
    return n


def _generic(path: str) -> str:
    return re.sub(r"\.\d+(?=\.|$)", ".*", path, count=1)


def find_units(gm: GraphModule) -> list:
    """The choice units of a captured graph, in graph order."""
    groups, tables = {}, set()
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target == aten.embedding.default and _param_of(node.args[0]):
            tables.add(_param_of(node.args[0]))
    units = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target == aten.embedding.default and _param_of(node.args[0]) is not None:
            units.append(Unit("embedding:" + _generic(module_path(node)), [node], EMBED_OPTIONS))
        elif node.target in _WEIGHT_ARG:
            xi, wi = _WEIGHT_ARG[node.target]
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


def _block_of(node: Node) -> str | None:
    m = re.match(r"^(.*?\.\d+)(\.|$)", module_path(node))
    return m.group(1) if m else None


def repeated_blocks(gm: GraphModule) -> list | None:
    """[pre, block 0, block 1, ..., post] node lists when the graph is a run of >= 4 identical blocks
    (same ops in the same order), else None."""
    nodes = list(gm.graph.nodes)
    ids = [_block_of(n) if n.op == "call_function" else None for n in nodes]
    first = next((i for i, b in enumerate(ids) if b is not None), None)
    if first is None:
        return None
    last = max(i for i, b in enumerate(ids) if b is not None)
    runs, cur = [], None
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


# ---------------------------------------------------------------------------------- pricing


def _local_elems(v, lay, mesh) -> int:
    return math.prod(local_shape(tuple(v.shape), lay, mesh))


def _redistribute(src: Layout, dst: Layout, v, mesh, grad: bool) -> list:
    """(axis, bytes, calls) of `kernels.Redistribute(src -> dst)` forward and backward."""
    e, size = v.element_size(), _local_elems(v, src, mesh)
    cur, out = list(src.placements), []
    for a in range(2):
        if split_dim(cur[a]) is not None and cur[a] != dst[a]:
            out.append((a, (mesh[a] - 1) * size * e))
            size *= mesh[a]
            cur[a] = Replicate()
    for a in range(2):
        s, d, g = cur[a], dst[a], mesh[a]
        if s == d:
            continue
        if isinstance(s, Partial) and isinstance(d, Shard) and parts(d) == 1:
            out.append((a, (g - 1) * size * e // g))
            size //= g
            if grad:
                out.append((a, (g - 1) * size * e))
            continue
        if isinstance(s, Partial):
            out.append((a, 2 * (g - 1) * size * e // g))
        if split_dim(d) is not None:
            size //= g
            if grad:
                out.append((a, (g - 1) * size * e))
    return [(a, b, 1) for a, b in out if mesh[a] > 1]


def _summa(strat, node, mesh, grads, cm: CostModel, est: Estimate) -> float:
    """Time of one SUMMA node (forward and the backward products that run), lowering chosen."""
    R, C = mesh
    x, w = strat.extra["x"], strat.extra["w"]
    xv = x.meta["val"]
    M, K, N = math.prod(xv.shape[:-1]), xv.shape[-1], node.meta["val"].shape[-1]
    e = xv.element_size()
    if strat.extra["transposed"]:
        per_axis = ((R - 1) * N * K * e / (R * C), (C - 1) * M * N * e / (R * C))
    else:
        per_axis = ((R - 1) * K * N * e / (R * C), (C - 1) * M * K * e / (R * C))
    products = 1 + int(x in grads) + int(w in grads)
    flops = 2 * (M / R) * K * (N / C) * products
    pieces = R + C - math.gcd(R, C)
    bw = sum(per_axis[a] / cm.beta[a] for a in range(2) if mesh[a] > 1) * products
    lat = {lo: sum(cm.alpha[a] * n for a in range(2) if mesh[a] > 1) * products
           for lo, n in (("broadcast", pieces), ("allgather", 1))}
    times = {"broadcast": lat["broadcast"] + max(bw, flops / cm.flops),
             "allgather": lat["allgather"] + bw + flops / cm.flops}
    lowering = min(times, key=times.get)
    est.lowerings[node.name] = lowering
    for a in range(2):
        est.bytes_per_axis[a] += per_axis[a] * products
    est.compute_s += flops / cm.flops
    est.comm_s += times[lowering] - flops / cm.flops
    return times[lowering]


def _flops(node, strat, layouts, mesh) -> float:
    """Forward + backward FLOPs of a local matmul-like node on one rank (0 for other ops)."""
    t = node.target
    if t in _WEIGHT_ARG or t in (aten.bmm.default, aten.baddbmm.default):
        xi = _WEIGHT_ARG.get(t, (1 if t == aten.baddbmm.default else 0, None))[0]
        x = node.args[xi]
        lay = strat.inputs.get(x, layouts.get(x))
        if not isinstance(lay, Layout) or not isinstance(node.meta.get("val"), torch.Tensor):
            return 0.0
        k = local_shape(tuple(x.meta["val"].shape), lay, mesh)[-1]
        return 6.0 * _local_elems(node.meta["val"], strat.output, mesh) * k
    if t == aten.scaled_dot_product_attention.default:
        b, h, s, d = local_shape(tuple(node.args[0].meta["val"].shape), strat.output, mesh)
        return 12.0 * b * h * s * node.args[1].meta["val"].shape[-2] * d
    return 0.0


@dataclass
class _NodeCost:
    shared: list  # (key, terms): collectives a later consumer may share (one Redistribute per (input, layout))
    terms: list  # (axis, bytes, calls) of the node's own kernel
    summa: Estimate | None  # a SUMMA node's time, bytes and lowering
    compute_s: float
    params: list  # (parameter node, bytes held)
    activation_bytes: float


def _node_cost(node, strat, layouts, mesh, grads, cm) -> _NodeCost:
    out_lay = strat.output
    outs = out_lay if isinstance(out_lay, tuple) else (out_lay,)
    split_axes = {a for lay in outs if isinstance(lay, Layout) for a in range(2) if not isinstance(lay[a], Replicate)}
    shared, terms, summa, params = [], [], None, []
    for inp, need in strat.inputs.items():
        have, v = layouts.get(inp), inp.meta.get("val")
        if not isinstance(v, torch.Tensor) or not isinstance(have, Layout):
            continue
        if have != need:
            shared.append(((inp, need), _redistribute(have, need, v, mesh, inp in grads)))
        sync = tuple(a for a in sorted(split_axes) if isinstance(need[a], Replicate) and mesh[a] > 1)
        if sync and v.dtype.is_floating_point and node.op != "output":
            n = _local_elems(v, need, mesh) * v.element_size()
            shared.append(((inp, need, sync), [(a, 2 * (mesh[a] - 1) * n // mesh[a], 1) for a in sync] if inp in grads else []))
        if inp.op == "placeholder" and inp.meta.get("autopar_role") == "param":
            params.append((inp, _local_elems(v, have, mesh) * v.element_size()))
    if strat.kernel == "summa":
        summa = Estimate()
        summa.time_s = _summa(strat, node, mesh, grads, cm, summa)
    else:
        terms = _kernel_terms(node, strat, mesh, grads)
    act = 0.0
    if node in grads and isinstance(node.meta.get("val"), torch.Tensor) and isinstance(out_lay, Layout):
        act = _local_elems(node.meta["val"], out_lay, mesh) * node.meta["val"].element_size()
    flops = _flops(node, strat, layouts, mesh) if strat.kernel != "summa" else 0.0
    return _NodeCost(shared, terms, summa, flops / cm.flops, params, act)


def price(nodes, layouts: dict, mesh, grads: set, cm: CostModel, params_seen: set | None = None,
          cache: dict | None = None) -> Estimate:
    """Estimated time, bytes and memory of `nodes` (already propagated) on one rank; a parameter in
    `params_seen` is not counted again (a tied table used before and after the blocks). `cache` keeps
    each node's costs under the key of its strategy (see `propagate_node`)."""
    est, seen = Estimate(), set()
    params_seen = set() if params_seen is None else params_seen
    for node in nodes:
        strat = node.meta.get("autopar_strategy")
        if node.op == "placeholder" or strat is None:
            continue
        if cache is not None:
            key = (node, node.meta.get("autopar_choice"), tuple(layouts.get(n) for n in node.all_input_nodes))
            nc = cache.get(key)
            if nc is None:
                nc = cache[key] = _node_cost(node, strat, layouts, mesh, grads, cm)
        else:
            nc = _node_cost(node, strat, layouts, mesh, grads, cm)
        terms = list(nc.terms)
        for key, ts in nc.shared:
            if key not in seen:
                seen.add(key)
                terms += ts
        if nc.summa is not None:
            est.add(nc.summa, 1)
        for a, nbytes, calls in terms:
            t = cm.collective(a, nbytes, calls)
            est.time_s += t
            est.comm_s += t
            est.bytes_per_axis[a] += nbytes
        est.time_s += nc.compute_s
        est.compute_s += nc.compute_s
        for p, nbytes in nc.params:
            if p not in params_seen:
                params_seen.add(p)
                est.param_bytes += nbytes
        est.activation_bytes += nc.activation_bytes
    return est


def _kernel_terms(node, strat, mesh, grads) -> list:
    """(axis, bytes, calls) of a norm or cross-entropy kernel's statistics."""
    terms, out_lay = [], strat.output
    if strat.kernel == "norm" and mesh[1] > 1:
        k = 2 if node.target == aten.layer_norm.default else 1
        t = math.prod(local_shape(tuple(node.meta["val"].shape), out_lay, mesh)[:-1])
        n = 2 * (mesh[1] - 1) * 4 * t // mesh[1]
        terms += [(1, n, 1)] * (k * (2 if node.args[0] in grads else 1))
    elif strat.kernel == "cross_entropy":
        rows = local_shape(tuple(node.args[0].meta["val"].shape), strat.inputs[node.args[0]], mesh)[0]
        if strat.extra["vocab_split"] and mesh[1] > 1:
            terms += [(1, 2 * (mesh[1] - 1) * 4 * rows // mesh[1], 1), (1, 2 * (mesh[1] - 1) * 8 * rows // mesh[1], 1)]
        if mesh[0] > 1:
            terms.append((0, 2 * (mesh[0] - 1) * 8 // mesh[0], 1))
    return terms


# ---------------------------------------------------------------------------------- search


@dataclass
class Choice:
    assignment: dict  # unit key -> option
    estimate: Estimate
    alternatives: dict  # unit key -> {option: best estimated step time with the unit forced to it}
    baselines: dict  # "2d" / "1d" -> Estimate of the fixed scheme
    evaluated: int
    units: list
    lowerings: dict  # SUMMA node name -> lowering
    solve_s: float = 0.0  # seconds the search took


class _Evaluator:
    def __init__(self, gm, mesh, cm, units, indivisible, fused, optimizer_states):
        self.gm, self.mesh, self.cm, self.units = gm, mesh_shape(mesh), cm, units
        self.options = dict(indivisible=indivisible, fused=fused, on_unsupported="replicate")
        self.grads = nodes_needing_grad(gm)
        self.blocks = repeated_blocks(gm)
        self.state_factor = 2 + optimizer_states  # parameter + gradient + optimizer states
        self.cache, self.rules, self.costs = {}, {}, {}  # estimates; rule results; node costs

    def _set(self, assignment: dict) -> None:
        for u in self.units:
            for n in u.nodes:
                n.meta["autopar_choice"] = assignment[u.key]

    def _run(self, sequence) -> tuple:
        layouts, res = {}, Propagation()
        for item in sequence:
            if isinstance(item, dict):  # alias: nodes skipped take the layouts of the ones that stand in
                layouts.update({n: layouts[m] for n, m in item.items()})
                continue
            propagate_node(item, layouts, res, self.mesh, **self.options, cache=self.rules)
        return layouts

    def estimate(self, assignment: dict) -> Estimate:
        key = tuple(sorted(assignment.items()))
        if key in self.cache:
            return self.cache[key]
        self._set(assignment)
        est = self._truncated() if self.blocks else None
        if est is None:
            nodes = list(self.gm.graph.nodes)
            est = price(nodes, self._run(nodes), self.mesh, self.grads, self.cm, cache=self.costs)
        est.memory_bytes = est.param_bytes * self.state_factor + est.activation_bytes
        self.cache[key] = est
        return est

    def _truncated(self) -> Estimate | None:
        pre, *blocks, post = self.blocks
        b0, b1, b2, last = blocks[0], blocks[1], blocks[2], blocks[-1]
        alias = dict(zip(last, b2))
        layouts = self._run(pre + b0 + b1 + b2 + [alias] + post)
        if [layouts.get(n) for n in b1] != [layouts.get(n) for n in b2]:
            return None  # not yet steady after two blocks: price the whole graph
        est, params = Estimate(), set()
        for part, k in ((pre, 1), (b0, 1), (b1, len(blocks) - 2), (b2, 1), (post, 1)):
            est.add(price(part, layouts, self.mesh, self.grads, self.cm, params, self.costs), k)
        return est


def choose(gm: GraphModule, mesh, cm: CostModel | None = None, memory_limit: float | None = None,
           indivisible: str = "replicate", fused: str = "regroup", optimizer_states: int = 2) -> Choice:
    """The assignment of strategies to `gm`'s units with the smallest estimated step time whose
    per-rank memory estimate is at most `memory_limit` bytes. Leaves `autopar_choice` and
    `autopar_lowering` set on the matmul nodes for the propagation that follows."""
    t0 = time.perf_counter()
    cm = cm or CostModel()
    units = find_units(gm)
    keys = list(dict.fromkeys(u.key for u in units))
    opts = {u.key: u.options for u in units}
    ev = _Evaluator(gm, mesh, cm, units, indivisible, fused, optimizer_states)
    fits = (lambda e: True) if memory_limit is None else (lambda e: e.memory_bytes <= memory_limit)
    tried = {}

    def run(assignment):
        tried[tuple(assignment[k] for k in keys)] = ev.estimate(assignment)

    baselines = {s: {k: s for k in keys} for s in ("2d", "1d")}
    for a in baselines.values():
        run(a)
    if math.prod(len(opts[k]) for k in keys) <= EXHAUSTIVE:
        for combo in itertools.product(*(opts[k] for k in keys)):
            run(dict(zip(keys, combo)))
    else:  # alternate: the block variables, then the others, each enumerated exactly, until stable
        shared = [k for k in keys if "*" in k]
        groups = [shared, [k for k in keys if k not in shared]]
        best = dict(min(baselines.values(), key=lambda a: ev.estimate(a).time_s))
        for _ in range(4):
            before = dict(best)
            for group in groups:
                for combo in itertools.product(*(opts[k] for k in group)):
                    a = {**best, **dict(zip(group, combo))}
                    run(a)
                feasible = [(e.time_s, c) for c, e in tried.items() if fits(e)]
                if feasible:
                    best = dict(zip(keys, min(feasible)[1]))
            if best == before:
                break
    feasible = [(e.time_s, c) for c, e in tried.items() if fits(e)]
    if not feasible:
        smallest = min(e.memory_bytes for e in tried.values())
        raise MemoryError(
            f"no strategy fits memory_limit={memory_limit / 2**30:.2f} GiB per rank on a {mesh_shape(mesh)} grid: "
            f"the smallest estimate among {len(tried)} assignments is {smallest / 2**30:.2f} GiB. Use more "
            f"devices, a smaller batch, or a larger limit."
        )
    _, combo = min(feasible)
    assignment = dict(zip(keys, combo))
    alternatives = {k: {o: min((e.time_s for c, e in tried.items() if c[i] == o and fits(e)), default=None)
                        for o in opts[k]} for i, k in enumerate(keys)}
    est = ev.estimate(assignment)
    lowerings = dict(est.lowerings)
    if ev.blocks:  # the estimate priced blocks 0-2; the others take the lowering of their stand-in
        pre, *blocks, post = ev.blocks
        for block in blocks[3:-1]:
            lowerings.update({n.name: lowerings[m.name] for n, m in zip(block, blocks[1]) if m.name in lowerings})
        lowerings.update({n.name: lowerings[m.name] for n, m in zip(blocks[-1], blocks[2]) if m.name in lowerings})
    apply(gm, units, assignment, lowerings, alternatives)
    return Choice(assignment, est, alternatives, {s: ev.estimate(a) for s, a in baselines.items()}, len(tried), units,
                  lowerings, time.perf_counter() - t0)


def apply(gm: GraphModule, units, assignment: dict, lowerings: dict, alternatives: dict | None = None) -> None:
    """Mark the nodes of `units` with their unit's option (and, for `explain`, the estimates of the
    alternatives) and SUMMA nodes with their lowering."""
    for u in units:
        for n in u.nodes:
            n.meta["autopar_choice"] = assignment[u.key]
            if alternatives is not None:
                n.meta["autopar_choice_why"] = (u.key, assignment[u.key], alternatives[u.key])
    for node in gm.graph.nodes:
        if node.name in lowerings:
            node.meta["autopar_lowering"] = lowerings[node.name]


def fixed(gm: GraphModule, strategy: str) -> None:
    """Mark every unit for one fixed strategy ("2d" or "1d")."""
    for u in find_units(gm):
        for n in u.nodes:
            n.meta["autopar_choice"] = strategy
