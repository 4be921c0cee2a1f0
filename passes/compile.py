"""The pass order: a captured graph to the per-rank program every rank runs (`compile_captured`).

    route_experts -> choose (strategy='auto') or pick_lowerings (lowering='auto') -> propagate
    -> insert_collectives -> localize -> group_siblings -> recompute

The result is a `Compiled`: the rewritten GraphModule, the capture it came from, the layouts of its
outputs and the fallbacks it runs. `autopar.program.build` captures a model's call and calls this.

>>> import torch
>>> from passes.capture.export import capture
>>> from passes.mesh import Grid
>>> from passes.options import Options
>>> cap = capture(torch.nn.Linear(4, 2), (torch.randn(2, 4),), {})
>>> comp, layouts = compile_captured(cap, (), Grid.for_planning(2, 2), Options())
>>> layouts["weight"], comp.out_layouts[0][0]
(S(1)S(0), S(0)S(1))
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from types import MappingProxyType

import torch

from passes.capture.export import Captured
from passes.compat import pytree
from passes.cost.model import CostModel
from passes.errors import FallbackWarning, MemoryLimitError
from passes.mesh import Grid, warn
from passes.meta import LAYOUT
from passes.nodes import arg, block_of, module_path
from passes.options import Options
from passes.search import strategy as strategies
from passes.search.lowering import fixed_estimate, pick_lowerings
from passes.transforms import context
from passes.transforms.group_siblings import group_siblings
from passes.transforms.insert_collectives import insert_collectives
from passes.transforms.localize import localize
from passes.transforms.propagate import propagate
from passes.transforms.recompute import block_runs, recompute
from passes.transforms.route_experts import route_experts

__all__ = ["Compiled", "RANDOM_OPS", "compile_captured"]


@dataclass
class Compiled:
    """The per-rank program for one input signature, and what running it needs."""

    gm: torch.fx.GraphModule
    captured: Captured
    out_layouts: list  # per flat output: (Layout, global shape) or None for non-tensors
    fallbacks: list  # [passes.transforms.propagate.Fallback]
    random: bool = False  # the graph draws random numbers (dropout)
    choice: object = None  # strategy="auto": the passes.search.strategy.Choice made
    data_parallel: str = "replicate"  # how the grid's replicas hold its blocks (data_parallel='auto' resolved)
    signature: tuple = ()  # the (training, input shapes and dtypes) it was compiled for; see `signature`
    flat: torch.fx.GraphModule | None = None  # recompute=...: `gm` before its regions were grouped

    @property
    def inspected(self) -> torch.fx.GraphModule:
        """The graph `explain` and `plan` read: every op as a node of its own (with recompute=..., the
        nodes the `Recompute` modules of `gm` run, marked with `passes.meta.RECOMPUTE`)."""
        return self.flat if self.flat is not None else self.gm


RANDOM_OPS = {  # the aten ops that draw random numbers
   "dropout", "native_dropout", "bernoulli", "bernoulli_", "rand", "rand_like", "randn", "randn_like",
           "feature_dropout", "alpha_dropout", "randint", "randint_like", "randperm", "uniform", "uniform_",
           "normal", "normal_", "exponential", "exponential_", "multinomial", "poisson", "rrelu",
           "rrelu_with_noise", "cauchy_", "geometric_", "log_normal_", "random_"}


def _draws_random(gm) -> bool:
    for n in gm.graph.nodes:
        if n.op != "call_function" or not hasattr(n.target, "overloadpacket"):
            continue
        name = n.target.overloadpacket.__name__
        if name in RANDOM_OPS or (name == "scaled_dot_product_attention" and arg(n, 4, "dropout_p", 0.0)):
            return True
    return False


def compile_captured(cap: Captured, key: tuple, grid: Grid, options: Options, choice=None, pinned=None,
                     search=None) -> tuple:
    """(Compiled, parameter name -> Layout) of a captured graph on `grid`, the passes in their order:
    route experts, the strategy of each matmul unit (options.strategy; with `choice`, a Choice made
    before, which a recompile for new shapes repeats instead of searching again; strategy='auto' calls
    `search(options)`, by default `passes.search.strategy.choose` here), each SUMMA product's lowering for a
    fixed strategy under lowering='auto' (`passes.search.lowering`), data_parallel='auto' resolved
    (`Compiled.data_parallel`: 'shard' only where 'replicate' does not fit memory_limit), propagate, insert collectives,
    localize, group sibling products, recompute. `pinned`: the parameter layouts of an earlier compile,
    kept as they are (see `passes.transforms.propagate`). Ops that run gathered whole are named in one
    FallbackWarning. A 1x1 grid runs the captured graph as it is. `key` becomes the signature."""
    chosen = None
    options = replace(options, replicas=grid.dp)
    # what runs behind the matmuls: the next SUMMA panel, each weight gradient's reduction (`overlap`)
    grid.prefetch = grid.overlap_grad_reduce = options.overlaps(CostModel.resolve(options.cost_model))
    sharding = _data_parallel(options)
    options = replace(options, data_parallel=sharding or "replicate")
    # the sequence over the cp ranks: positions, masks, targets (generation compiles with context_parallel 1)
    if grid.cp > 1 and options.context_parallel > 1 and cap.context is None:
        cap.context = context.prepare(cap.gm, grid.cp, grid.cp_index, grid.shape[1], cap.buffers, cap.constants,
                                      cap.sources)
    if grid.world > 1:
        route_experts(cap.gm, grid.shape, options.moe_dispatch)
    if grid.world > 1 and options.strategy in ("1d", "3d"):
        strategies.fixed(cap.gm, options.strategy)
    elif grid.world > 1 and choice is not None:
        chosen = choice
        sharding = getattr(choice, "data_parallel", None) or options.data_parallel
        strategies.apply(cap.gm, strategies.find_units(cap.gm), choice.assignment, choice.lowerings,
                         choice.alternatives)
    elif grid.world > 1 and options.strategy == "auto":
        chosen, sharding = _search(cap, grid, options, search, sharding)
    if sharding is None:  # data_parallel='auto' under a fixed strategy: shard only where replicas do not fit
        est, _ = fixed_estimate(cap.gm, grid.shape, CostModel.resolve(options.cost_model), options.strategy, options)
        sharding = "shard" if est.memory_bytes > options.memory_limit_bytes else "replicate"
    if grid.world > 1 and chosen is None and options.fixed_lowering is None:
        pick_lowerings(cap.gm, grid.shape, CostModel.resolve(options.cost_model), options.strategy, options)
    prop = propagate(cap.gm, grid.shape, options, pinned)
    if grid.world > 1:
        # a SUMMA node without a LOWERING mark (none under lowering='auto') runs the broadcast lowering
        gm = insert_collectives(cap.gm, grid, lowering=options.fixed_lowering or "broadcast")
        localize(gm, grid.shape, (grid.r, grid.c))
        group_siblings(gm, grid)
    else:  # a 1x1 grid: every layout is the whole tensor; run the captured graph as it is
        gm = cap.gm
    if grid.cp > 1 and options.context_parallel > 1:
        context.finish(gm, grid, options.context_attention)  # attention over the cp ranks' keys and values
    out_node = gm.graph.output_node()
    outs = []
    for a in pytree.tree_leaves(out_node.args[0]):
        v = a.meta.get("val") if isinstance(a, torch.fx.Node) else None
        outs.append((a.meta[LAYOUT], tuple(v.shape)) if isinstance(v, torch.Tensor) else None)
    if prop.gathering_fallbacks:
        lines = "\n".join(f"  {f.node.name} ({f.node.target}) in {f.path or '<top>'}: {f.reason}"
                          for f in prop.gathering_fallbacks)
        warn(
            f"autopar: {len(prop.gathering_fallbacks)} op(s) run unsplit (gathered whole, computed on every "
            f"rank, split again):\n{lines}",
            FallbackWarning,
            stacklevel=4,
        )
    random = _draws_random(gm)
    flat, only = None, None
    mode = options.recompute if isinstance(options.recompute, str) else None  # None / False: none
    if mode is None and chosen is not None and chosen.recompute_blocks:  # the search's way to fit memory_limit
        mode, only = "blocks", set(chosen.recompute_blocks)
    if mode == "blocks" and options.recompute_blocks is not None:  # the first k blocks of this graph
        only = set(list(dict.fromkeys(block_of(run[0]) for run in block_runs(gm) if run))[:options.recompute_blocks])
    if mode:
        flat, gm = gm, recompute(gm, grid, mode, only)
    grid.places = MappingProxyType({**grid.places, **_places(flat if flat is not None else gm)})
    return Compiled(gm, cap, outs, prop.fallbacks, random, chosen, sharding, key, flat), prop.param_layouts


def _places(gm) -> dict:
    """Each op node's module path, for the hang diagnosis (`passes.ops.flight`): its collectives' tags are
    these node names."""
    return {n.name: path for n in gm.graph.nodes
            if n.op in ("call_function", "call_module") and (path := module_path(n))}


def _data_parallel(options: Options) -> str | None:
    """How the replicas hold the grid's blocks, or None where data_parallel='auto' asks the estimate
    (replicas and a memory_limit); 'auto' without either is 'replicate'."""
    if options.data_parallel != "auto":
        return options.data_parallel
    return None if options.replicas > 1 and options.memory_limit_bytes is not None else "replicate"


def _search(cap: Captured, grid: Grid, options: Options, search, sharding: str | None) -> tuple:
    """strategy='auto': (Choice, data_parallel). Under data_parallel='auto' (`sharding` None) the search
    runs with replicated and with sharded replicas, and the faster estimate that fits memory_limit wins
    (replicated on a tie: the estimate does not price the replica axis, which moves the same bytes
    both ways; sharding only lowers the memory)."""
    def run(opts):
        return search(opts) if search is not None else strategies.choose(
            cap.gm, grid.shape, CostModel.resolve(opts.cost_model), opts)

    if sharding is not None:
        return run(options), sharding
    found, refused = {}, None
    for mode in ("replicate", "shard"):
        try:
            found[mode] = run(replace(options, data_parallel=mode))
        except MemoryLimitError as e:
            refused = e
    if not found:
        assert refused is not None, "a search that found nothing raised"
        raise refused
    sharding = min(found, key=lambda m: (found[m].estimate.time_s, m != "replicate"))
    chosen = found[sharding]
    chosen.data_parallel = sharding
    strategies.apply(cap.gm, strategies.find_units(cap.gm), chosen.assignment, chosen.lowerings,
                     chosen.alternatives)  # the last search left its own marks
    return chosen, sharding
