"""Propagation: give every node of a captured graph a layout.

Requires `node.meta["val"]` (from torch.export) and `node.meta[ROLE]` on placeholders (from
`capture`). Adds `node.meta[LAYOUT]` (a Layout, or a tuple for multi-output ops) and, on
call nodes, `node.meta[STRATEGY]` (the rule's Strategy).

One pass in topological order. User inputs, buffers and constants start replicated (a buffer
marked `PLACED`, a generation KV cache, starts in that layout); a parameter has
no layout until its first consumer asks for one, so a weight is stored the way its matmul or lookup
wants it. A tied parameter (one tensor, two uses) keeps the layout of its first use; the second use
sees it already placed and adapts (an LM head on an embedding table becomes SUMMA ABT). Transposes of
an unplaced parameter wait for their consumer and pass its request back to the parameter. A recompile
for new input shapes passes the first compile's layouts as `pinned`: every parameter starts placed,
so the stored blocks serve every shape.

>>> import torch
>>> from passes.capture.export import capture
>>> cap = capture(torch.nn.Linear(4, 2), (torch.randn(2, 4),))
>>> res = propagate(cap.gm, mesh=(2, 2))
>>> [(n.name, n.meta[LAYOUT]) for n in cap.gm.graph.nodes if n.op != "output"]
[('p_weight', S(1)S(0)), ('p_bias', RS(0)), ('input', RR), ('linear', S(0)S(1))]
"""

from __future__ import annotations

from dataclasses import dataclass, field
from collections.abc import Mapping
from typing import NamedTuple

import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.fx import GraphModule, Node

from passes.compat import HigherOrderOperator
from passes.capture.functionalize import writes_first_arg
from passes.layout import REPLICATED, GridShape, Layout, ShardingError, mesh_shape, moved, parts, split_dim
from passes.nodes import module_path, source_line
from passes.meta import CHOICE, LAYOUT, PARAM, PLACED, ROLE, STRATEGY
from passes.options import DEFAULTS, Options
from passes.rules.registry import Strategy, Unsupported, lookup
from passes.nodes import tensor_inputs, val
from passes.rules.fallback import creation, fallback
from passes.rules.norms import NORMS, consumer_choices
from passes.rules.views import TRANSPOSES, is_cast, permutation
from passes.errors import UnsupportedError



class Fallback(NamedTuple):
    """An op no rule splits, run whole on every rank (its inputs gathered, its output split again)."""
    node: Node
    path: str  # module path of the op, "" at the top level
    reason: str  # the strategy's note: "fallback: <why no rule applies>"
    costly: bool  # it gathers a split input or keeps a weight whole (else its inputs were whole anyway)


@dataclass
class Propagation:
    param_layouts: dict = field(default_factory=dict)  # canonical name -> Layout
    fallbacks: list = field(default_factory=list)  # [Fallback]

    @property
    def gathering_fallbacks(self) -> list:
        """Fallbacks that gather a split input or keep a weight whole; the others run on inputs that
        were whole anyway (mask and position-id construction) and cost nothing."""
        return [f for f in self.fallbacks if f.costly]


def _claim(node: Node, need: Layout, layouts: dict, res: Propagation) -> None:
    """Place an unplaced parameter (or a chain of transposes and casts of one) as its consumer asks."""
    layouts[node] = need
    if node.op == "placeholder":
        res.param_layouts[node.meta[PARAM]] = need
        return
    src = node.args[0]
    nd = len(val(node).shape)
    perm = permutation(node)
    back = Layout(tuple(moved(p, perm[p.dim % nd]) if split_dim(p) is not None else p for p in need.placements))
    node.meta[STRATEGY] = Strategy({src: back}, need)
    _claim(src, back, layouts, res)


def _strategy(node: Node, layouts: dict, mesh: tuple, indivisible: str) -> Strategy:
    """The rule's strategy for `node`; with indivisible='uneven' the rule sees a `GridShape` that lets
    it split dims the grid does not divide (torch.chunk blocks)."""
    mesh = GridShape(mesh, uneven=indivisible == "uneven")
    ins = tensor_inputs(node)
    if not isinstance(val(node), (torch.Tensor, tuple, list)):
        return Strategy({}, REPLICATED)
    if not ins:
        return creation(node)
    if (node.target in TRANSPOSES or is_cast(node)) and layouts.get(node.args[0]) is None:
        return Strategy({}, None)  # waits for its consumer (see _claim)
    if writes_first_arg(node) and layouts.get(node.args[0]) is None:
        return Strategy({}, None)  # an update of an unplaced parameter waits for a reader to place it
    if isinstance(node.target, HigherOrderOperator):
        _refuse_higher_order(node)
    rule = lookup(node.target)
    if rule is None:
        return fallback(node, f"no sharding rule for {node.target}")
    try:
        return rule(node, layouts, mesh)
    except Unsupported as e:
        return fallback(node, str(e))
    except ShardingError as e:
        if indivisible != "error":
            return fallback(node, str(e))
        where = module_path(node) or "<top>"
        raise ShardingError(
            f"{e}\n  at node {node.name} ({node.target}) in module {where}; source: {source_line(node)}\n"
            f"  Pick sizes divisible by the grid dims, or pass indivisible='replicate' to run such ops unsplit "
            f"(correct, with a warning, but the weight is stored whole on every rank)."
        ) from None


def _refuse_higher_order(node: Node) -> None:
    """A higher-order op (torch.cond, torch.map, a checkpointed or compiled region) carries a subgraph
    that the rules cannot see into; grad-mode and autocast regions were already inlined by capture."""
    raise ShardingError(
        f"higher-order op {node.target.name()} at node {node.name} in module {module_path(node) or '<top>'} "
        f"runs a subgraph autopar cannot split; source: {source_line(node)}.\n"
        f"  Write that part with plain tensor ops (torch.where instead of torch.cond, a Python loop instead "
        f"of torch.map); `with torch.no_grad()` and `torch.autocast` regions are supported."
    )


def _check_inplace_fallback(node: Node, layouts: dict, gathers: bool) -> None:
    """A replicated fallback of an in-place op whose target is split would mutate a gathered copy:
    refuse it. A whole target arrives as it is (only the other operands are gathered) and is updated."""
    if gathers and writes_first_arg(node) and layouts.get(node.args[0]) not in (None, REPLICATED):
        raise ShardingError(
            f"in-place op {node.target} at node {node.name} in module {module_path(node) or '<top>'} mutates "
            f"a tensor laid out {layouts.get(node.args[0])}, which it cannot update in place once gathered; "
            f"source: {source_line(node)}. Write it out of place (x = x + y instead of x += y)."
        )


def _storable(need: Layout, fused: str) -> Layout:
    """The layout a parameter is stored in when a consumer asks for `need`. With fused='regroup' an
    interleaved (Strided) request is stored as plain blocks and regrouped in the graph each step, so
    every parameter is an ordinary sharded DTensor (torch.distributed.checkpoint cannot save Strided
    ones); with fused='interleave' it is stored interleaved and no regrouping runs."""
    stored = tuple(Replicate() if isinstance(p, Partial) else p for p in need.placements)  # a bias added
    # once to a partial sum is stored whole and zeroed on all but one member in the graph
    if fused == "interleave":
        return Layout(stored)
    return Layout(tuple(Shard(p.dim) if parts(p) > 1 else p for p in stored))


def _refuse_fallback(node: Node, why: str) -> None:
    raise ShardingError(
        f"on_unsupported='error': node {node.name} ({node.target}) in module {module_path(node) or '<top>'} has "
        f"no way to run split ({why}) and would be gathered whole on every rank; source: {source_line(node)}.\n"
        f"  Rewrite it with supported ops (see the supported-ops table, docs/guide/supported.md), or pass "
        f"on_unsupported='replicate' to accept the replicated fallback (correct, with a warning)."
    )


def rule_key(node: Node, layouts: dict) -> tuple:
    """What a rule's result depends on: the node, its strategy choice and its inputs' layouts."""
    readers = consumer_choices(node) if node.target in NORMS else ()
    return node, node.meta.get(CHOICE), tuple(layouts.get(n) for n in node.all_input_nodes), readers


def propagate_node(node: Node, layouts: dict, res: Propagation, mesh: tuple, options: Options,
                   cache: dict | None = None) -> None:
    """Give one node its layout (and strategy), its inputs having theirs in `layouts`, as `options`
    (indivisible, fused, on_unsupported) say. Rules are pure functions of the node, its inputs' layouts
    and its strategy choice: `cache` (shared by many runs over one graph, as the strategy search does)
    keeps their results under that key."""
    if node.op == "placeholder":
        role = node.meta.get(ROLE)
        layouts[node] = res.param_layouts.get(node.meta.get(PARAM)) if role == "param" \
            else node.meta.get(PLACED, REPLICATED)
    elif node.op == "get_attr":
        layouts[node] = REPLICATED
    elif node.op == "call_function":
        strat: Strategy | None
        if cache is None:
            strat = _strategy(node, layouts, mesh, options.indivisible)
        else:
            key = rule_key(node, layouts)
            strat = cache.get(key)
            if strat is None:
                strat = cache[key] = _strategy(node, layouts, mesh, options.indivisible)
        # a fallback costs something when it gathers a split input or keeps a weight whole
        costly = strat.fallback and any(layouts.get(n) != REPLICATED for n in strat.inputs)
        for inp, need in strat.inputs.items():
            if layouts.get(inp) is None:
                _claim(inp, _storable(need, options.fused), layouts, res)
        node.meta[STRATEGY] = strat
        layouts[node] = strat.output
        if strat.fallback:
            if costly and options.on_unsupported == "error":
                _refuse_fallback(node, strat.note.removeprefix("fallback: "))
            _check_inplace_fallback(node, layouts, costly)
            res.fallbacks.append(Fallback(node, module_path(node), strat.note, costly))
    elif node.op == "output":
        summed = {}  # partial outputs: the caller gets the sum
        for out in node.all_input_nodes:
            lay = layouts[out]
            if isinstance(lay, Layout) and lay.has_partial:
                summed[out] = Layout(tuple(Replicate() if isinstance(p, Partial) else p for p in lay.placements))
        node.meta[STRATEGY] = Strategy(summed, None)
    else:
        raise UnsupportedError(f"node {node.name}: op kind {node.op} is not handled")


def propagate(gm: GraphModule, mesh, options: Options | None = None, pinned: Mapping | None = None) -> Propagation:
    """`mesh`: the grid shape (R, C), or q for q x q. `options`: how indivisible weights, fused
    projections and ops without a split form are handled (default: `DEFAULTS`, parallelize's).
    `pinned`: parameter name -> Layout already decided (by the first compile of a model called with
    new shapes): those parameters start placed, rules adapt to them and claim nothing, so the stored
    blocks serve every input shape; a consumer that needs another layout gets a redistribution."""
    mesh = mesh_shape(mesh)
    options = DEFAULTS if options is None else options
    res = Propagation(param_layouts=dict(pinned or {}))
    layouts: dict = {}
    for node in gm.graph.nodes:
        propagate_node(node, layouts, res, mesh, options)
    for node in gm.graph.nodes:  # in-place updates of parameters, now placed by their readers
        if writes_first_arg(node) and layouts.get(node) is None:
            if layouts.get(node.args[0]) is None:  # updated, never read: kept whole
                _claim(node.args[0], REPLICATED, layouts, res)
            propagate_node(node, layouts, res, mesh, options)
    for node in gm.graph.nodes:  # parameters nobody placed (unused, or a tied twin) and waiting views
        if layouts.get(node) is None:
            name = node.meta.get(PARAM)
            layouts[node] = res.param_layouts.setdefault(name, REPLICATED) if name else REPLICATED
        node.meta[LAYOUT] = layouts[node]
    return res
