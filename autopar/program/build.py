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

import torch
import torch.distributed as dist

from autopar.program.consensus import decided_once
from autopar.program.guards import check_mixed_dtypes, handshake
from autopar.program.memo import shared
from passes import Grid, capture as capture_graph
from passes.capture.export import Captured, retarget_meta
from passes.compat import pytree
from passes.compile import Compiled, compile_captured as compile_graph
from passes.cost.model import CostModel
from passes.errors import FallbackWarning
from passes.options import Options
from passes.search import strategy as strategies
from autopar.errors import UsageError

__all__ = ["Compiled", "FallbackWarning", "capture", "check_example_inputs", "compile_program", "compile_captured",
           "resolve_cost_model", "signature", "cache_off_kwargs", "refuse_kv_cache", "input_device"]


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


def check_example_inputs(model, args: tuple, kwargs: dict | None, who: str) -> None:
    """Before any capture: the example inputs fit `model.forward`. Without them (or with a required
    argument missing) torch.export fails inside the model with an error about tracing (transformers:
    'You must specify exactly one of input_ids or inputs_embeds'), which says nothing of the
    argument autopar needs."""
    kwargs = kwargs or {}
    try:
        sig = inspect.signature(model.forward)
    except (TypeError, ValueError):  # a builtin or C-level forward: nothing to check against
        return
    how = ("autopar captures the model by running forward once on a batch of the shapes you will train with: "
           "pass it as example_inputs=(...) (positional, a tuple) and/or example_kwargs=dict(...) (keywords)")
    try:
        sig.bind(*args, **kwargs)
    except TypeError as e:
        raise UsageError(f"{who}: the example inputs do not fit {type(model).__name__}.forward{sig}: {e}. {how}, "
                         f"e.g. example_inputs=(ids,)") from None
    takes = [p for p in sig.parameters.values() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if not args and not kwargs and takes:
        main = getattr(model, "main_input_name", None) or takes[0].name
        raise UsageError(f"{who} needs example inputs and got none: {how}, e.g. "
                         + (f"example_kwargs=dict({main}=ids, labels=ids) for a transformers model"
                            if hasattr(model, "main_input_name") else f"example_inputs=({main},)"))


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
        raise UsageError(
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
    return shared("capture", model, signature(args, kwargs, model.training), lambda: _capture(model, args, kwargs))


def _capture(model, args, kwargs) -> Captured:
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


def _choose(cap: Captured, grid: Grid, options: Options):
    """strategy='auto': one search, on global rank 0 when ranks run (a search stopped by its time
    budget could end elsewhere on another rank, and one search spares the others' CPU), its Choice (or
    its error) sent to every rank."""
    def search():
        return strategies.choose(cap.gm, grid.shape, CostModel.resolve(options.cost_model), options)

    if grid.mesh is None or not dist.is_initialized() or dist.get_world_size() == 1:
        return search()
    # one searcher: global rank 0, or with pipeline stages each stage's first rank (its program is its own)
    first = (grid.stage * grid.dp * grid.world) if getattr(grid, "stages", 1) > 1 else 0

    def send(box):
        if first == 0 and getattr(grid, "stages", 1) == 1:
            dist.broadcast_object_list(box, src=0)
            return
        if grid.dp > 1 and grid.r == grid.c == 0:  # to the stage's replicas (their grid position (0, 0))
            dist.broadcast_object_list(box, src=first, group=grid.dp_group)
        dist.broadcast_object_list(box, src=grid.base, group=grid.world_group)  # then within each replica's grid

    choice = decided_once(search, dist.get_rank() == first, send, handshake("sending rank 0's strategy choice"))
    if dist.get_rank() != first:  # the searcher's search marked its graph; mark this rank's the same way
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


def resolve_cost_model(spec) -> CostModel:
    """None (published GPU-cluster figures), a CostModel, a dict or a path of `autopar calibrate` JSON."""
    return CostModel.resolve(spec)


def compile_captured(cap: Captured, key: tuple, grid: Grid, options: Options, choice=None, pinned=None) -> tuple:
    """`compile_program` from a graph already captured (and, for generation, marked: `autopar.generate`
    renames its parameters and places its cache before this runs); `key` becomes its signature. The
    passes run in `passes.compile`; strategy='auto' searches on rank 0 and sends its choice to all."""
    return compile_graph(cap, key, grid, options, choice, pinned, search=lambda opts: _choose(cap, grid, opts))
