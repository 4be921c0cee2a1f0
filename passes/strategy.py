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

The estimate of an assignment runs the real rules (`propagate_node`, results cached across
assignments) and prices the result with `passes.estimate` (an alpha-beta model per mesh axis).
Memory: parameters times (2 + optimizer states) plus every intermediate that needs a gradient. With
identical blocks the estimate propagates the first three blocks and the last one stands in for the
rest (checked: the third block must see the layouts the second saw), so its cost does not grow with
depth.
"""

from __future__ import annotations

import itertools
import math
import re
import time
from dataclasses import dataclass

import torch
from torch.fx import GraphModule, Node

from passes.cost import nodes_needing_grad
from passes.estimate import MATMULS, CostModel, Estimate, price
from passes.layout import mesh_shape
from passes.propagate import Propagation, module_path, propagate_node

__all__ = ["CostModel", "Estimate", "Choice", "choose", "apply", "fixed", "estimate_fixed", "find_units",
           "repeated_blocks", "OPTIONS"]

aten = torch.ops.aten
OPTIONS = ("2d", "1d", "rep")
EMBED_OPTIONS = ("2d", "1d")
EXHAUSTIVE = 1024  # assignments enumerated outright; more alternate block / non-block enumeration
_THROUGH = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.t.default,
            aten.transpose.int, aten.permute.default, aten._to_copy.default, aten.clone.default,
            aten.alias.default, aten.detach.default}


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
    return n if isinstance(n, Node) and n.op == "placeholder" and n.meta.get("autopar_role") == "param" else None


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


# ---------------------------------------------------------------------------------- search


@dataclass
class Choice:
    assignment: dict  # unit key -> option
    estimate: Estimate
    alternatives: dict  # unit key -> {option: best estimated step time with the unit forced to it}
    baselines: dict  # "2d" / "1d" -> Estimate of the fixed scheme
    evaluated: int
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


def choose(gm: GraphModule, mesh, cm: CostModel, memory_limit: float | None = None,
           indivisible: str = "replicate", fused: str = "regroup", optimizer_states: int = 2) -> Choice:
    """The assignment of strategies to `gm`'s units with the smallest estimated step time whose
    per-rank memory estimate is at most `memory_limit` bytes. Leaves `autopar_choice` and
    `autopar_lowering` set on the matmul nodes for the propagation that follows."""
    t0 = time.perf_counter()
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
    return Choice(assignment, est, alternatives, {s: ev.estimate(a) for s, a in baselines.items()}, len(tried),
                  lowerings, time.perf_counter() - t0)


def apply(gm: GraphModule, units, assignment: dict, lowerings: dict, alternatives: dict | None = None) -> None:
    """Mark the nodes of `units` with their unit's option (and, for `explain`, the estimates of the
    alternatives) and SUMMA nodes with their lowering."""
    for u in units:
        for n in u.nodes:
            n.meta["autopar_choice"] = assignment[u.key]
            if alternatives is not None:
                n.meta["autopar_choice_why"] = (assignment[u.key], alternatives[u.key])
    for node in gm.graph.nodes:
        if node.name in lowerings:
            node.meta["autopar_lowering"] = lowerings[node.name]


def fixed(gm: GraphModule, strategy: str) -> None:
    """Mark every unit for one fixed strategy ("2d" or "1d")."""
    for u in find_units(gm):
        for n in u.nodes:
            n.meta["autopar_choice"] = strategy


def estimate_fixed(gm: GraphModule, mesh, cm: CostModel, strategy: str, optimizer_states: int = 2) -> Estimate:
    """The estimate of one fixed strategy ("2d", "1d" or "rep") for every unit of `gm` on `mesh`."""
    units = find_units(gm)
    ev = _Evaluator(gm, mesh, cm, units, "replicate", "regroup", optimizer_states)
    return ev.estimate({u.key: strategy if strategy in u.options else "1d" for u in units})
