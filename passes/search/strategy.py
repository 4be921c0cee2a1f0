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
1-layer one, and an encoder-decoder has one set of variables per stack (`encoder.layers.*`,
`decoder.layers.*`). When every variable's options multiply to at most `EXHAUSTIVE` the search
enumerates them all (exact for the model below). Otherwise it is a coordinate search: each stack's
variables, then the variables outside stacks, are enumerated exactly with the rest held at the best
assignment so far (a group with more than `GROUP` assignments becomes overlapping windows of
consecutive variables), for at most `ROUNDS` rounds or until a round changes nothing, so the number
of assignments evaluated grows with the number of variables, not exponentially. The all-2d and all-1d
assignments are always evaluated, so the choice is never estimated slower than the better fixed scheme.

The search says so (a `SearchWarning`) when it runs longer than `PROGRESS_S`, and stops at
`search_budget` seconds (default `BUDGET_S`; None: no limit) with the best assignment found so far
and a warning naming the budget.

The estimate of an assignment runs the real rules (`propagate_node`, results cached across
assignments) and prices the result with `passes.search.estimate` (an alpha-beta model per mesh axis).
Memory: parameters times (2 + optimizer states) plus every intermediate that needs a gradient. With
identical blocks the estimate propagates the first three blocks and the last one stands in for the
rest (checked: the third block must see the layouts the second saw), so its cost does not grow with
depth.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, replace

from torch.fx import GraphModule, Node

from passes.cost.planned import nodes_needing_grad
from passes.search.estimate import CostModel, Estimate, price
from passes.search.replica_cost import ReplicaCost, gathered_share
from passes.search.units import EMBED_OPTIONS, OPTIONS, Unit, find_units, repeated_blocks
from passes.layout import mesh_shape
from passes.meta import CHOICE, CHOICE_WHY, LOWERING
from passes.mesh import warn
from passes.options import BUDGET_S, DEFAULTS, Options, format_bytes
from passes.transforms.propagate import Propagation, propagate_node
from passes.search.recompute_cost import BlockTrade, block_trade
from passes.errors import MemoryLimitError, SearchWarning

__all__ = ["CostModel", "Estimate", "Choice", "SearchWarning", "Unit", "choose", "apply", "fixed", "block_lowerings",
           "fixed_layouts",
           "estimate_fixed", "estimate_assignment", "fixed_assignment", "find_units", "repeated_blocks",
           "search_groups", "OPTIONS", "EMBED_OPTIONS", "BUDGET_S"]

EXHAUSTIVE = 1024  # assignments enumerated outright; more: the coordinate search
GROUP = 81  # assignments one step of the coordinate search enumerates at most (4 three-way variables)
ROUNDS = 4  # coordinate-search rounds at most (it stops earlier once a round changes nothing)
PROGRESS_S = 5.0  # a search still running after this many seconds warns once that it is


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
    complete: bool = True  # False: the search stopped at its time budget with the best found so far
    recompute_blocks: tuple = ()  # the repeated blocks recomputed in backward to fit memory_limit
    data_parallel: str = "replicate"  # with replicas: how they hold the grid's blocks (data_parallel='auto')


class Evaluator:
    """Estimates of assignments of one graph. A training step (the default) prices forward, backward and
    gradient reductions and holds parameters, gradients, optimizer states and what backward saves;
    `options.forward_only` prices the forward alone and holds the parameters only. `lowering` None: each
    SUMMA product at its faster lowering; else that lowering for all (what a fixed strategy runs)."""

    def __init__(self, gm, mesh, cm, units, options: Options, lowering: str | None = None):
        # overlap=False (or 'auto' on a model that hides nothing): every transfer priced in line
        cm = cm if options.overlaps(cm) else replace(cm, hidden=0.0)
        self.gm, self.mesh, self.cm, self.units = gm, mesh_shape(mesh), cm, units
        self.options = replace(options, on_unsupported="replicate")  # a fallback is priced, never refused
        self.lowering = lowering
        self.grads = set() if options.forward_only else nodes_needing_grad(gm)  # no backward: nothing needs one
        self.blocks = repeated_blocks(gm)
        self.replicas = ReplicaCost(cm, options, *gathered_share(gm, options.reshard_after_forward))
        self.cache: dict[tuple, Estimate] = {}  # sorted assignment items -> estimate
        self.rules: dict = {}  # propagate.rule_key -> the rule's Strategy
        self.costs: dict = {}  # propagate.rule_key -> the node's priced costs (estimate.price)

    def _set(self, assignment: dict) -> None:
        for u in self.units:
            for n in u.nodes:
                n.meta[CHOICE] = assignment[u.key]

    def _run(self, sequence) -> dict:
        layouts: dict = {}  # node -> layout
        res = Propagation()
        for item in sequence:
            if isinstance(item, dict):  # alias: nodes skipped take the layouts of the ones that stand in
                layouts.update({n: layouts[m] for n, m in item.items()})
                continue
            propagate_node(item, layouts, res, self.mesh, self.options, cache=self.rules)
        return layouts

    def estimate(self, assignment: dict) -> Estimate:
        key = tuple(sorted(assignment.items()))
        if key in self.cache:
            return self.cache[key]
        self._set(assignment)
        est, trade = self._truncated()
        if est is None:
            nodes = list(self.gm.graph.nodes)
            est = price(nodes, self._run(nodes), self.mesh, self.grads, self.cm, cache=self.costs,
                        lowering=self.lowering)
        # a frozen parameter holds no gradient or optimizer state: the parameter alone
        trained = est.param_bytes - est.frozen_param_bytes
        factor = 1 if self.options.forward_only else self.replicas.factor
        est.memory_bytes = trained * factor + est.frozen_param_bytes + est.activation_bytes
        est.time_s += self.replicas.seconds(trained, est.param_bytes, est.time_s)
        self._recompute(est, trade)
        self.cache[key] = est
        return est

    def _recompute(self, est: Estimate, trade: BlockTrade | None) -> None:
        """Recompute blocks in the estimate: all of them with recompute='blocks'; with recompute=None
        and a memory limit, the fewest that make it fit (all of them when none is enough: the smallest
        footprint). recompute=False, 'selective' and graphs without steady repeated blocks are priced
        as they are."""
        mode, limit = self.options.recompute, self.options.memory_limit_bytes
        if self.options.forward_only:  # nothing is saved for a backward: nothing to recompute
            return
        if trade is None or mode == "selective" or mode is False or (mode is None and limit is None):
            return
        k = trade.blocks if mode == "blocks" or limit is None else trade.blocks_for(est.memory_bytes, limit)
        if k is None:
            k = trade.blocks if trade.memory_with(est.memory_bytes, trade.blocks) < est.memory_bytes else 0
        est.time_s += k * trade.forward_s
        est.memory_bytes = trade.memory_with(est.memory_bytes, k)
        est.recomputed = trade.ids[:k]

    def _truncated(self) -> tuple:
        """(the estimate that prices blocks 0-2 alone (the last block takes block 2's layouts) and counts
        block 1 once per middle block, what recomputing blocks trades); (None, None) when the graph has
        no repeated blocks or they are not yet steady after two (then the whole graph is priced)."""
        if self.blocks is None:
            return None, None
        pre, *blocks, post = self.blocks
        b0, b1, b2, last = blocks[0], blocks[1], blocks[2], blocks[-1]
        alias = dict(zip(last, b2))
        layouts = self._run(pre + b0 + b1 + b2 + [alias] + post)
        if [layouts.get(n) for n in b1] != [layouts.get(n) for n in b2]:
            return None, None  # not yet steady after two blocks: price the whole graph
        est, middle = Estimate(), Estimate()
        params: set[Node] = set()  # parameters already counted (a tied table)
        for part, k in ((pre, 1), (b0, 1), (b1, len(blocks) - 2), (b2, 1), (post, 1)):
            one = price(part, layouts, self.mesh, self.grads, self.cm, params, self.costs, self.lowering)
            est.add(one, k)
            middle = one if part is b1 else middle
        return est, block_trade(blocks, middle, layouts, self.mesh, self.grads)



class _OutOfTime(Exception):
    pass


def _stack(key: str) -> str | None:
    """The stack of repeated blocks a unit key belongs to ('model.decoder.layers'), None outside stacks."""
    path = key.split(":", 1)[1].split("|")[0]
    return path.split(".*")[0] if ".*" in path else None


def _windows(keys: list, opts: dict) -> list:
    """`keys` as one group when it has at most GROUP assignments, else windows of consecutive keys of at
    most GROUP assignments each, each overlapping the next by half: neighbouring units hand each other
    their layouts, so a pair that a window boundary splits is still enumerated together in the next."""
    def size(ks):
        return math.prod(len(opts[k]) for k in ks)

    if size(keys) <= GROUP:
        return [keys]
    out, i = [], 0
    while True:
        j = i + 1
        while j < len(keys) and size(keys[i:j + 1]) <= GROUP:
            j += 1
        out.append(keys[i:j])
        if j == len(keys):
            return out
        i = max(i + 1, j - (j - i) // 2)


def search_groups(keys: list, opts: dict) -> list:
    """The groups of variables the coordinate search enumerates in turn: each stack's variables, then
    those outside stacks (graph order within each), a group above GROUP assignments split into windows."""
    scopes: dict[str | None, list[str]] = {}  # stack (None: outside stacks) -> its unit keys
    for k in keys:
        scopes.setdefault(_stack(k), []).append(k)
    rest = scopes.pop(None, [])
    return [g for ks in [*scopes.values(), rest] if ks for g in _windows(ks, opts)]


class _Search:
    """The assignments tried and their estimates; `run` refuses to start one after the budget."""

    def __init__(self, ev, keys, fits, budget_s, space, t0):
        self.ev, self.keys, self.fits, self.budget_s, self.space, self.t0 = ev, keys, fits, budget_s, space, t0
        self.tried, self.noted = {}, False

    def run(self, assignment: dict, timed: bool = True) -> None:
        spent = time.perf_counter() - self.t0
        if timed and self.budget_s is not None and spent > self.budget_s:
            raise _OutOfTime
        if timed and not self.noted and spent > PROGRESS_S:
            self.noted = True
            best = self.best()
            so_far = (f"best estimate so far {self.ev.estimate(best).time_s * 1e3:.3f} ms per step" if best
                      else "none fits the memory limit yet")
            warn(
                f"strategy search still running after {spent:.0f} s: {len(self.tried)} of {self.space} assignments "
                f"of {len(self.keys)} unit variables evaluated, {so_far}; "
                + ("no time limit (search_budget=None)" if self.budget_s is None else
                   f"it stops by search_budget={self.budget_s} s with the best found"), SearchWarning, stacklevel=3)
        self.tried[tuple(assignment[k] for k in self.keys)] = self.ev.estimate(assignment)

    def best(self) -> dict | None:
        """The fastest assignment tried whose memory fits, or None."""
        feasible = [(e.time_s, c) for c, e in self.tried.items() if self.fits(e)]
        return dict(zip(self.keys, min(feasible)[1])) if feasible else None


def _coordinate_search(search: _Search, groups: list, opts: dict, best: dict) -> None:
    for _ in range(ROUNDS):
        before = dict(best)
        for group in groups:
            for combo in itertools.product(*(opts[k] for k in group)):
                search.run({**best, **dict(zip(group, combo))})
            best = search.best() or best
        if best == before:
            return


def choose(gm: GraphModule, mesh, cm: CostModel, options: Options | None = None, extra: tuple = ()) -> Choice:
    """The assignment of strategies to `gm`'s units with the smallest estimated step time whose
    per-rank memory estimate is at most `options.memory_limit` bytes, searched for at most
    `options.search_budget` seconds (None: no limit; when it runs out, the best found so far, with a
    `SearchWarning`); `options` defaults to `DEFAULTS`, and its `cost_model` is not read: `cm` is the
    model already resolved. Leaves `CHOICE` and `LOWERING` (`passes.meta`) set on the matmul nodes for
    the propagation that follows. `extra`: options every matmul unit may take besides 2d / 1d / rep,
    each also priced as a fixed scheme (("3d",) on a cube's (q, q*q) grid)."""
    t0 = time.perf_counter()
    options = DEFAULTS if options is None else options
    memory_limit, search_budget = options.memory_limit_bytes, options.search_budget
    units = [replace(u, options=u.options + extra) if u.options == OPTIONS else u for u in find_units(gm)]
    keys = list(dict.fromkeys(u.key for u in units))
    opts = {u.key: u.options for u in units}
    ev = Evaluator(gm, mesh, cm, units, options, options.fixed_lowering)
    fits = (lambda e: True) if memory_limit is None else (lambda e: e.memory_bytes <= memory_limit)
    space = math.prod(len(opts[k]) for k in keys)
    search = _Search(ev, keys, fits, search_budget, space, t0)
    baselines: dict[str, dict[str, str]] = {s: fixed_assignment(units, s) for s in ("2d", "1d", *extra)}
    for a in baselines.values():
        search.run(a, timed=False)
    complete = True
    try:
        if space <= EXHAUSTIVE:
            for combo in itertools.product(*(opts[k] for k in keys)):
                search.run(dict(zip(keys, combo)))
        else:
            faster = min(baselines.values(), key=lambda a: ev.estimate(a).time_s)
            start = dict(faster)
            _coordinate_search(search, search_groups(keys, opts), opts, start)
    except _OutOfTime:
        complete = False
    tried, assignment = search.tried, search.best()
    stopped = "" if complete else f" (the search stopped at search_budget={search_budget} s; a larger one may find one)"
    if assignment is None:
        assert memory_limit is not None, "without a memory limit every assignment fits"
        least = min(tried.values(), key=lambda e: e.memory_bytes)
        how = f", recomputing all {len(least.recomputed)} repeated blocks" if least.recomputed else ""
        raise MemoryLimitError(
            f"no strategy fits memory_limit={format_bytes(memory_limit)} per rank on a {mesh_shape(mesh)} grid: "
            f"the smallest estimate among {len(tried)} assignments is {format_bytes(least.memory_bytes)}{how}"
            f"{stopped}. Use more devices, a smaller batch, or a larger limit."
        )
    alternatives = {k: {o: min((e.time_s for c, e in tried.items() if c[i] == o and fits(e)), default=None)
                        for o in opts[k]} for i, k in enumerate(keys)}
    est = ev.estimate(assignment)
    if not complete:
        warn(
            f"strategy search stopped at its time budget (search_budget={search_budget} s) after {len(tried)} of "
            f"{space} assignments: the plan uses the best found so far, estimated {est.time_s * 1e3:.3f} ms per "
            f"step (fixed 2d {ev.estimate(baselines['2d']).time_s * 1e3:.3f} ms, fixed 1d "
            f"{ev.estimate(baselines['1d']).time_s * 1e3:.3f} ms). Pass a larger search_budget (seconds; None: no "
            f"limit) to search further.", SearchWarning, stacklevel=2)
    lowerings = block_lowerings(ev, est)
    apply(gm, units, assignment, lowerings, alternatives)
    return Choice(assignment, est, alternatives, {s: ev.estimate(a) for s, a in baselines.items()}, len(tried),
                  lowerings, time.perf_counter() - t0, complete, est.recomputed)


def block_lowerings(ev: Evaluator, est: Estimate) -> dict:
    """SUMMA node name -> lowering for every block: the estimate priced blocks 0-2 (when it took the
    block shortcut) and the others take the lowering of their stand-in."""
    lowerings = dict(est.lowerings)
    if ev.blocks:
        pre, *blocks, post = ev.blocks
        for block in blocks[3:-1]:
            lowerings.update({n.name: lowerings[m.name] for n, m in zip(block, blocks[1]) if m.name in lowerings})
        lowerings.update({n.name: lowerings[m.name] for n, m in zip(blocks[-1], blocks[2]) if m.name in lowerings})
    return lowerings


def apply(gm: GraphModule, units, assignment: dict, lowerings: dict, alternatives: dict | None = None) -> None:
    """Mark the nodes of `units` with their unit's option (and, for `explain`, the estimates of the
    alternatives) and SUMMA nodes with their lowering."""
    for u in units:
        for n in u.nodes:
            n.meta[CHOICE] = assignment[u.key]
            if alternatives is not None:
                n.meta[CHOICE_WHY] = (assignment[u.key], alternatives[u.key])
    for node in gm.graph.nodes:
        if node.name in lowerings:
            node.meta[LOWERING] = lowerings[node.name]


def fixed(gm: GraphModule, strategy: str) -> None:
    """Mark every unit for one fixed strategy ("2d" or "1d")."""
    for u in find_units(gm):
        for n in u.nodes:
            n.meta[CHOICE] = strategy


def estimate_fixed(gm: GraphModule, mesh, cm: CostModel, strategy: str, options: Options | None = None,
                   lowering: str | None = None) -> Estimate:
    """The estimate of one fixed strategy ("2d", "1d" or "rep") for every unit of `gm` on `mesh`, with
    `options` (default `DEFAULTS`) for indivisible weights, fused projections, optimizer states and a
    forward alone (`forward_only`); `lowering`: every SUMMA product's (None: each at its faster one)."""
    return estimate_assignment(gm, mesh, cm, fixed_assignment(find_units(gm), strategy), options, lowering)


def fixed_assignment(units, strategy: str) -> dict:
    """Every unit under one fixed strategy, as `fixed` marks them: "3d" for all (an embedding under
    "3d" runs its 2D rule on the cube's grid), else the strategy where a unit offers it and "1d" where
    it does not (an embedding offers no "rep")."""
    return {u.key: strategy if strategy in u.options or strategy == "3d" else "1d" for u in units}


def estimate_assignment(gm: GraphModule, mesh, cm: CostModel, assignment: dict, options: Options | None = None,
                        lowering: str | None = None) -> Estimate:
    """The estimate of `assignment` (unit key -> option, as `Choice.assignment`) on `mesh`; see
    `estimate_fixed`. Leaves the assignment's `CHOICE` marks on the units' nodes."""
    units = find_units(gm)
    missing = sorted({u.key for u in units} - set(assignment))
    assert not missing, f"the assignment names no option for units {missing[:3]}"
    ev = Evaluator(gm, mesh, cm, units, DEFAULTS if options is None else options, lowering)
    return ev.estimate(assignment)


def part_costs(gm: GraphModule, mesh, cm: CostModel, strategy: str, block: str | None,
               options: Options | None = None, *, lowering: str | None, assignment: dict | None = None,
               forward: bool = False) -> tuple:
    """(repeated block `block`'s Estimate, the graph's less one such Estimate per block) under one fixed strategy on
    `mesh`: bytes received per mesh axis and the collectives' time (with `cm`'s matmul rate infinite,
    `time_s` is communication alone), every SUMMA product in `lowering` (None: each at its faster one).
    What `passes.cost.step` scales to a model's depth and batch. `assignment`: a searched mix
    (`Choice.assignment`) instead of `strategy`. `forward`: the same two for the forward's collectives
    alone follow (what a recomputed forward runs again)."""
    from passes.nodes import block_of

    units = find_units(gm)
    ev = Evaluator(gm, mesh, CostModel(cm.alpha, cm.beta, math.inf, cm.source), units,
                   DEFAULTS if options is None else options, lowering)
    ev._set(assignment if assignment is not None else fixed_assignment(units, strategy))
    nodes = list(gm.graph.nodes)
    layouts = ev._run(nodes)
    inside = [n for n in nodes if block is not None and block_of(n) == block]
    n_blocks = len({block_of(n) for n in nodes} - {None})
    out = []
    for grads in (ev.grads, set()) if forward else (ev.grads,):  # no gradient: the forward's steps alone
        one = price(inside, layouts, ev.mesh, grads, ev.cm, set(), lowering=lowering)
        rest = price(nodes, layouts, ev.mesh, grads, ev.cm, set(), lowering=lowering)
        rest.add(one, -n_blocks)  # all but the blocks: the first block's extra (its input's layout) stays here
        out += [one, rest]
    return tuple(out)


def fixed_layouts(gm: GraphModule, mesh, strategy: str, options: Options | None = None) -> tuple:
    """(an Evaluator of `gm` on `mesh`, each node's layout) under one fixed `strategy`, SUMMA products in the
    broadcast lowering; the nodes' chosen rules left in their meta (`passes.meta.STRATEGY`)."""
    units = find_units(gm)
    ev = Evaluator(gm, mesh, CostModel((0.0, 0.0), (1.0, 1.0), math.inf, "bytes"), units,
                   DEFAULTS if options is None else options, "broadcast")
    ev._set(fixed_assignment(units, strategy))
    return ev, ev._run(list(gm.graph.nodes))
