"""The compile pipeline `parallelize`, `plan` and the benchmarks share: one input signature in, one
per-rank program out.

    capture          the model's aten graph for one call (torch.export, KV cache off, meta-aware)
    compile_program  capture, then (strategy='auto') choose, propagate, insert collectives, localize
    resolve_cost_model  the alpha-beta model strategy='auto' prices with, from what the user passed

>>> import torch
>>> from passes.mesh import Grid
>>> from passes.options import Options
>>> comp, layouts = compile_program(torch.nn.Linear(4, 2), (torch.randn(2, 4),), {}, Grid.for_planning(2, 2),
...                                 Options())
>>> layouts["weight"], comp.signature
(S(1)S(0), (True, (), ((2, 4), torch.float32)))

A `Compiled` is the program for one signature: the rewritten GraphModule, where its inputs come from,
the layouts of its outputs and the fallbacks it runs. `ParallelModule` keeps one per (mode, shapes).
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass

import torch
import torch.distributed as dist

from passes import Grid, capture as capture_graph, insert_collectives, localize, propagate
from passes.search import strategy as strategies
from passes.capture.export import Captured, retarget_meta
from passes.transforms.group_siblings import group_siblings
from passes.compat import pytree
from passes.meta import LAYOUT
from passes.mesh import warn
from passes.options import Options
from passes.transforms.recompute import recompute
from passes.transforms.route_experts import route_experts
from passes.nodes import arg
from autopar.planning import calibrate as calibrate
from autopar.program.guards import check_mixed_dtypes, handshake
from autopar.errors import FallbackWarning

__all__ = ["Compiled", "FallbackWarning", "capture", "compile_program", "compile_captured", "resolve_cost_model",
           "signature", "cache_off_kwargs", "refuse_kv_cache", "input_device"]



@dataclass
class Compiled:
    """The per-rank program for one input signature, and what running it needs."""

    gm: torch.fx.GraphModule
    captured: Captured
    out_layouts: list  # per flat output: (Layout, global shape) or None for non-tensors
    fallbacks: list  # [passes.transforms.propagate.Fallback]
    random: bool = False  # the graph draws random numbers (dropout)
    choice: object = None  # strategy="auto": the passes.search.strategy.Choice made
    signature: tuple = ()  # the (training, input shapes and dtypes) it was compiled for; see `signature`
    flat: torch.fx.GraphModule | None = None  # recompute=...: `gm` before its regions were grouped

    @property
    def inspected(self) -> torch.fx.GraphModule:
        """The graph `explain` and `plan` read: every op as a node of its own (with recompute=..., the
        nodes the `Recompute` modules of `gm` run, marked with `passes.meta.RECOMPUTE`)."""
        return self.flat if self.flat is not None else self.gm


_RANDOM = {"dropout", "native_dropout", "bernoulli", "bernoulli_", "rand", "rand_like", "randn", "randn_like",
           "feature_dropout", "alpha_dropout", "randint", "randint_like", "randperm", "uniform", "uniform_",
           "normal", "normal_", "exponential", "exponential_", "multinomial", "poisson", "rrelu",
           "rrelu_with_noise", "cauchy_", "geometric_", "log_normal_", "random_"}


def _draws_random(gm) -> bool:
    for n in gm.graph.nodes:
        if n.op != "call_function" or not hasattr(n.target, "overloadpacket"):
            continue
        name = n.target.overloadpacket.__name__
        if name in _RANDOM or (name == "scaled_dot_product_attention" and arg(n, 4, "dropout_p", 0.0)):
            return True
    return False


def signature(args, kwargs, training: bool) -> tuple:
    """The cache key of a call: train/eval mode, the keywords given (a new set, such as the Trainer's
    added num_items_in_batch, is captured anew), each input's shape and dtype (repr of a non-tensor),
    and, last, the autocast regions the call runs in when any is on (a program captured without
    autocast computes in the parameters' dtype: the same call under autocast is captured anew, so its
    outputs have the dtypes one process gives). Calls with equal signatures run the same program."""
    kwargs = kwargs or {}
    flat = pytree.tree_leaves((tuple(args), {k: kwargs[k] for k in sorted(kwargs)}))
    autocast = tuple((d, torch.get_autocast_dtype(d)) for d in AUTOCAST_DEVICES if torch.is_autocast_enabled(d))
    return (training, tuple(sorted(kwargs))) + tuple(
        (tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else repr(t) for t in flat) + \
        ((("autocast",) + autocast,) if autocast else ())


AUTOCAST_DEVICES = ("cpu", "cuda")  # the autocast states a call's signature records


@contextlib.contextmanager
def _no_kv_cache(model):
    """HF models return a KV-cache object when config.use_cache is on, which export cannot trace and the
    2D engine does not shard: capture with it off, and put the user's setting back afterwards."""
    config = getattr(model, "config", None)
    had = getattr(config, "use_cache", None)
    if had:
        config.use_cache = False
    try:
        yield
    finally:
        if had:
            config.use_cache = had


def refuse_kv_cache(kwargs) -> None:
    """A call that asks for a generation KV cache is refused before anything is traced or run."""
    if kwargs and kwargs.get("use_cache"):
        raise ValueError(
            "use_cache=True asks for a generation KV cache, which a forward call of the parallel model does "
            "not keep: call it without use_cache (autopar turns it off) or with use_cache=False; to "
            "generate, call pmodel.generate(input_ids, ...), which keeps a KV cache split over the grid."
        )


def cache_off_kwargs(model) -> dict:
    """use_cache=False for models whose forward takes it (T5 builds a cache from the call argument even
    when its config says no); passed on every capture and call unless the user gives it."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return {}
    return {"use_cache": False} if "use_cache" in params else {}


def input_device(args, kwargs) -> torch.device:
    """The device of the first tensor among the inputs (CPU when there is none): where the shards go."""
    for t in pytree.tree_leaves((args, kwargs or {})):
        if isinstance(t, torch.Tensor):
            return t.device
    return torch.device("cpu")


def capture(model, args, kwargs) -> Captured:
    """The model's graph for one call. A model with meta parameters is traced all on meta and the
    graph pointed back at the inputs' device; matmuls mixing integer inputs and floating weights are
    refused by name."""
    refuse_kv_cache(kwargs)
    device = input_device(args, kwargs)
    meta = any(p.is_meta for p in model.parameters())
    if meta:  # trace all on meta (inputs too, so ops mixing them agree), then point the graph at `device`
        args, kwargs = pytree.tree_map_only(torch.Tensor, lambda t: t.to("meta"), (args, kwargs))
    with _no_kv_cache(model):
        cap = capture_graph(model, args, kwargs)
    cap.device = device
    if meta:
        retarget_meta(cap.gm, device)
    check_mixed_dtypes(cap.gm)
    return cap


def resolve_cost_model(spec) -> strategies.CostModel:
    """None (published GPU-cluster figures), a CostModel, a dict or a path of `autopar calibrate` JSON."""
    if spec is None or isinstance(spec, strategies.CostModel):
        return spec or strategies.CostModel.from_dict(calibrate.DEFAULT)
    return strategies.CostModel.from_dict(calibrate.validate(spec) if isinstance(spec, dict) else calibrate.load(spec))


def _choose(cap: Captured, grid: Grid, options: Options):
    """strategy='auto': one search, on global rank 0 when ranks run (a search stopped by its time
    budget could end elsewhere on another rank, and one search spares the others' CPU), its Choice (or
    its error) sent to every rank."""
    def search():
        return strategies.choose(cap.gm, grid.shape, resolve_cost_model(options.cost_model), options)

    if grid.mesh is None or not dist.is_initialized() or dist.get_world_size() == 1:
        return search()
    box = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = ("ok", search())
        except (MemoryError, ValueError) as e:  # raised on every rank below, with rank 0's text
            box[0] = ("error", type(e).__name__, str(e))
    with handshake("sending rank 0's strategy choice"):
        dist.broadcast_object_list(box, src=0)
    if box[0][0] == "error":
        raise {"MemoryError": MemoryError, "ValueError": ValueError}[box[0][1]](box[0][2])
    choice = box[0][1]
    if dist.get_rank() != 0:  # rank 0's search marked its graph; mark this rank's the same way
        strategies.apply(cap.gm, strategies.find_units(cap.gm), choice.assignment, choice.lowerings,
                         choice.alternatives)
    return choice


def compile_program(model, args, kwargs, grid: Grid, options: Options, choice=None, pinned=None) -> tuple:
    """(Compiled, parameter name -> Layout) for one call of `model` on `grid`: capture, the strategy
    of each matmul unit (options.strategy; with `choice`, a Choice made before, which a recompile for
    new shapes repeats instead of searching again), propagate, insert collectives, localize. `pinned`:
    the parameter layouts of an earlier compile, kept as they are (see `passes.transforms.propagate`). Ops that
    run gathered whole are named in one FallbackWarning. A 1x1 grid runs the captured graph as it is."""
    return compile_captured(capture(model, args, kwargs), signature(args, kwargs, model.training), grid,
                            options, choice, pinned)


def compile_captured(cap: Captured, key: tuple, grid: Grid, options: Options, choice=None, pinned=None) -> tuple:
    """`compile_program` from a graph already captured (and, for generation, marked: `autopar.generate`
    renames its parameters and places its cache before this runs); `key` becomes its signature."""
    chosen = None
    if grid.world > 1:
        route_experts(cap.gm, grid.shape, options.moe_dispatch)
    if grid.world > 1 and options.strategy == "1d":
        strategies.fixed(cap.gm, "1d")
    elif grid.world > 1 and choice is not None:
        chosen = choice
        strategies.apply(cap.gm, strategies.find_units(cap.gm), choice.assignment, choice.lowerings,
                         choice.alternatives)
    elif grid.world > 1 and options.strategy == "auto":
        chosen = _choose(cap, grid, options)
    prop = propagate(cap.gm, grid.shape, options, pinned)
    if grid.world > 1:
        gm = insert_collectives(cap.gm, grid, options.lowering)
        localize(gm, grid.shape, (grid.r, grid.c))
        group_siblings(gm, grid)
    else:  # a 1x1 grid: every layout is the whole tensor; run the captured graph as it is
        gm = cap.gm
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
    flat, mode, only = None, options.recompute, None
    if mode is None and chosen is not None and chosen.recompute_blocks:  # the search's way to fit memory_limit
        mode, only = "blocks", set(chosen.recompute_blocks)
    if mode:  # None / False: nothing recomputed
        flat, gm = gm, recompute(gm, grid, mode, only)
    return Compiled(gm, cap, outs, prop.fallbacks, random, chosen, key, flat), prop.param_layouts
