"""The private and undocumented torch APIs autopar relies on, in one place.

torch makes no promise about names with a leading underscore, `_internal` modules or undocumented functions: any
release may move or change them. Every such use in `passes/`, `autopar/` and the tests goes through this module, so
that an upgrade of torch has one file to check. Each entry says where it lives, the torch versions it was checked on,
and what stops working if it moves.

pyproject.toml requires torch>=2.11; every entry was checked on 2.13.0 (CPU build), and the fast parity subset of
`make test-compat` runs on 2.11.0. A moved name fails here, when the first compiler module that uses this one is
imported, with an ImportError or AttributeError naming it, except the two imported on first use (`fake_store`,
`fake_tensor_mode`), which fail when `autopar.plan` measures activations. Aliases are the very objects torch defines
(`set_grad_enabled is torch._C._set_grad_enabled`): graphs print as before.
"""

from __future__ import annotations

import contextlib
import sys

import torch
import torch.distributed as dist
# torch.utils._pytree: tree_leaves / tree_flatten / tree_unflatten and the TreeSpec of export's call spec. Checked on
# 2.13.0. If it moves: capture (flattening the user's inputs), parallelize's output layouts and plan's activation
# measurement fail to import.
import torch.utils._pytree as pytree
# torch._ops: the types of aten overloads, overload packets and higher-order ops (torch.cond, the no_grad / autocast
# wrappers of export). Checked on 2.13.0. If they move: rule registration (`passes.rules.register`), functionalize's
# aten check and propagate's refusal of higher-order ops.
from torch._ops import HigherOrderOperator, OpOverload, OpOverloadPacket
# torch.amp.autocast_mode._enter_autocast / _exit_autocast: what export's own graphs call for an autocast region.
# Checked on 2.13.0. If they move: `passes.capture.regions` cannot inline autocast regions (models using
# torch.autocast in forward fail to capture).
from torch.amp.autocast_mode import _enter_autocast as enter_autocast
from torch.amp.autocast_mode import _exit_autocast as exit_autocast
# DTensor's interleaved split, `_StridedShard(dim, split_factor=k)`: the layout of a fused projection (q|k|v) stored
# interleaved. Checked on 2.13.0 (a subclass of torch._C._distributed.StridedShard there). If it moves or changes its
# fields (`dim`, `split_factor`): `passes.layout` fails to import, and with it all of autopar.
from torch.distributed.tensor.placement_types import _StridedShard as StridedShard
# TorchDispatchMode: intercepts aten calls (bench's count of functional collectives' bytes, the train checks' op
# counts). Checked on 2.13.0. If it moves: `autopar.bench` and tests/checks_train.py.
from torch.utils._python_dispatch import TorchDispatchMode
# FSDP2's communication interfaces, which `FSDPModule.set_custom_all_gather` / `set_custom_reduce_scatter` take
# (public methods, private classes). Checked on 2.13.0. If they move: `autopar.parallel.sharded`
# (data_parallel='shard') fails to import, and with it `autopar.parallelize`.
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather as FSDPAllGather
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter as FSDPReduceScatter
# torch.nn.modules.module._IncompatibleKeys: the (missing_keys, unexpected_keys) named tuple that
# nn.Module.load_state_dict returns, which a pipelined model's load_state_dict returns too. Checked on 2.13.0. If it
# moves: `autopar.parallel.pipeline` fails to import.
from torch.nn.modules.module import _IncompatibleKeys as IncompatibleKeys

from passes.errors import TorchVersionError

__all__ = ["HigherOrderOperator", "OpOverload", "OpOverloadPacket", "StridedShard", "TorchDispatchMode",
           "FSDPAllGather", "FSDPReduceScatter", "IncompatibleKeys", "default_store", "all_gather_single",
           "call_spec", "disable_torch_function_subclass", "dtensor_parts", "enter_autocast", "exit_autocast",
           "fake_deepcopy", "fake_world", "fake_tensor_mode", "real_tensors", "static_pipeline_warmup", "storage_key",
           "custom_op_body", "data_dependent_errors", "group_timeout", "implicit_replication", "in_backward",
           "in_torch_compile_call", "legacy_reduction", "parse_to", "pytree", "reduce_scatter_single",
           "register_flattened_mesh", "register_ordered", "set_grad_enabled", "set_version_counter",
           "keep_effect_order_in_inductor", "CACHEABLE_EFFECTS"]

# torch._C._set_grad_enabled: what export's graphs call to switch grad mode; `passes.capture.regions` inlines no_grad
# regions as calls to it (the graph's target is this very function). Checked on 2.13.0. If it moves: models with
# `torch.no_grad()` inside forward fail to capture.
set_grad_enabled = torch._C._set_grad_enabled

# torch._C.DisableTorchFunctionSubclass: the context in which a tensor subclass's __torch_function__ runs torch's own
# implementation (the pattern torch's subclassing docs show). Checked on 2.13.0. If it moves:
# `autopar.program.outputs.Output` (the outputs a user computes a loss on) fails to import.
disable_torch_function_subclass = torch._C.DisableTorchFunctionSubclass

# torch.nn._reduction.legacy_get_string(size_average, reduce): what torch's loss functions do with their deprecated
# size_average/reduce arguments. Checked on 2.13.0. If it moves: `autopar.program.outputs` fails to import (a user's
# loss on the outputs).
from torch.nn._reduction import legacy_get_string as legacy_reduction  # noqa: E402

# torch._C._nn._parse_to: Module.to's own argument parser (device, dtype, non_blocking, memory_format). Checked on
# 2.13.0. If it moves: capture of models that call `self.x.to(dtype)` on a submodule inside forward (Switch
# Transformers, NLLB-MoE) fails.
parse_to = torch._C._nn._parse_to

# torch._C._autograd._unsafe_set_version_counter((tensors), (versions)): puts back a parameter's version after an in-
# place update under no_grad, so that autograd does not see it as modified. Checked on 2.13.0. If it moves: graphs
# with in-place parameter updates in forward fail at run time.
set_version_counter = torch._C._autograd._unsafe_set_version_counter

# torch.distributed.all_gather_single / reduce_scatter_single(out, inp, group=...): the single-tensor collectives that
# 2.13 offers in place of all_gather_into_tensor / reduce_scatter_tensor (deprecated there); torch 2.11 and 2.12 have
# only the older two, which take the same tensors in the same order. Not in torch's stable API docs. Checked on 2.11.0
# and 2.13.0. If they move or change signature: every all-gather and reduce-scatter autopar inserts
# (`passes.ops.comm`) fails at run time.
if hasattr(dist, "all_gather_single"):
    all_gather_single = dist.all_gather_single
    reduce_scatter_single = dist.reduce_scatter_single
else:  # torch 2.11, 2.12

    def all_gather_single(output_tensor, input_tensor, group=None, async_op=False):
        """`dist.all_gather_into_tensor` under 2.13's name."""
        return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)

    def reduce_scatter_single(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):  # noqa: A002
        """`dist.reduce_scatter_tensor` under 2.13's name."""
        return dist.reduce_scatter_tensor(output, input, op=op, group=group, async_op=async_op)


def call_spec(ep) -> tuple:
    """(in_spec, out_spec) of an ExportedProgram: how the user's arguments flatten into the graph's
    inputs and how its outputs unflatten. `ep.call_spec` is undocumented (checked on 2.13.0, where it is
    built from `ep.module_call_graph[0].signature`). If it moves: every capture fails."""
    spec = ep.call_spec
    return spec.in_spec, spec.out_spec


@contextlib.contextmanager
def fake_world(rank: int, world: int):
    """`init_process_group("fake")` (its store from torch.testing._internal.distributed.fake_pg: moves no data) as
    `rank` of `world` while active; DTensor's sharding-propagation caches (ShardingPropagator.propagate_op_sharding's
    LRU, torch._C._clear_DTensor_sharding_propagator_cache) emptied on entry and exit: their keys take equal meshes for
    one whatever the rank, and a rank got another's specs, on its mesh. Checked on 2.13.0. If they move:
    `autopar.plan`'s measure_activations and `autopar.dry_run` fail."""
    from torch.distributed.tensor import DTensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def clear() -> None:
        DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
        getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", lambda: None)()

    clear()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()
        clear()


def storage_key(t) -> int:
    """A key of the storage under `t`, equal for its views, real or fake (`StorageImpl`'s address,
    `untyped_storage()._cdata`). Checked on 2.13.0. If it moves: `autopar.dry_run`'s saved bytes."""
    return t.untyped_storage()._cdata


def custom_op_body(name: str):
    """The Python function a `torch.library.custom_op` named `name` ('autopar::summa') was made from (its
    eager body), through torch._library.custom_ops. Checked on 2.13.0. If it moves: `autopar.dry_run` on
    fake tensors counts no collective."""
    from torch._library.custom_ops import _maybe_get_opdef

    return _maybe_get_opdef(name)._init_fn


def data_dependent_errors() -> tuple:
    """The errors fake tensors raise where a step reads a value (`.item()`, a data-dependent shape); 2.13.0."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    return (DataDependentOutputException, DynamicOutputShapeException, GuardOnDataDependentSymNode)


def static_pipeline_warmup():
    """Make torch's pipeline schedules take the static metadata mode after their P2P warm-up vote (whose
    result travels from the last stage back to the first), as a run whose every stage was given its
    input and output shapes takes it; returns the function that undoes it. For `autopar.dry_run`, which
    simulates the stages one at a time, so that no vote's answer reaches the first (the vote's tensors real,
    when the step runs on fake ones). Through schedules._PipelineSchedule._warmup_p2p and stage.InferenceMode
    (private; 2.11 has neither, nor the vote: nothing to do). Checked on 2.13.0 and 2.11.0."""
    from torch.distributed.pipelining import schedules, stage as stage_module

    base = schedules._PipelineSchedule
    orig, InferenceMode = getattr(base, "_warmup_p2p", None), getattr(stage_module, "InferenceMode", None)
    if orig is None or InferenceMode is None:
        return lambda: None

    def warmup(self, stages, has_backward, p2p_done):
        with real_tensors():  # its vote tensors real inside a fake step: the vote reads them on the host
            orig(self, stages, has_backward, p2p_done)
        for stage in stages:
            if getattr(stage, "_inference_mode", None) is not None:
                stage._inference_mode = InferenceMode.STATIC

    base._warmup_p2p = warmup

    def restore():
        base._warmup_p2p = orig
    return restore


def real_tensors():
    """A context in which new tensors are real even inside a FakeTensorMode (torch's
    unset_fake_temporarily), for host-side bookkeeping beside a fake step. Checked on 2.13.0."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    return unset_fake_temporarily()


def fake_tensor_mode(allow_real: bool = False):
    """A FakeTensorMode (torch._subclasses.fake_tensor), imported on first use: tensors with shapes and
    dtypes but no storage. Checked on 2.13.0. If it moves: `autopar.plan` cannot measure activation
    memory (measure_activations=True)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=allow_real)  # allow_real: real buffers beside fake parameters


def fake_deepcopy(obj, mode):
    """A deep copy of `obj` whose FakeTensors (of FakeTensorMode `mode`) are copied as new fake tensors of
    that mode (a FakeTensor refuses the plain deepcopy: it has no data pointer), through torch's
    FakeCopyMode (torch._subclasses.fake_tensor). Checked on 2.13.0. If it moves: `autopar.dry_run`
    captures the model once per simulated rank instead of once."""
    import copy

    from torch._subclasses.fake_tensor import FakeCopyMode

    with FakeCopyMode(mode):
        return copy.deepcopy(obj)


def is_fake(t) -> bool:
    """Whether `t` is a FakeTensor (shapes only, as `autopar.plan` runs a rank's graph). Checked on
    2.13.0. If it moves: the expert kernel cannot tell a planning run from a real one."""
    from torch._subclasses.fake_tensor import is_fake as fake

    return fake(t)


def group_timeout(group, device_type: str):
    """The timeout `group` (a ProcessGroup) was created with, e.g. init_process_group(timeout=...), as a
    timedelta; None where torch does not say. Its backend keeps it in the private `options._timeout`.
    Checked on 2.13.0 (gloo). If it moves: None, and the grid's groups get torch's default timeout."""
    try:
        return group._get_backend(torch.device(device_type)).options._timeout
    except (AttributeError, RuntimeError, TypeError):
        return None


# init_process_group's store, for the hang reports (`passes.ops.flight`; None: each rank's own). Checked on 2.13.0.
default_store = getattr(dist.distributed_c10d, "_get_default_store", None)


def register_flattened_mesh(mesh, name: str, flat) -> None:
    """Record `flat` (a 1-D DeviceMesh over all of `mesh`'s ranks) as `mesh` flattened under `name`. DeviceMesh keeps
    its flattened meshes in the root mesh's private `_flatten_mapping` (found with the private `_get_root_mesh()`);
    DTensor looks there when it reduces a value partial over every mesh axis (the total norm of torch's
    `clip_grad_norm_`). `DeviceMesh._flatten` would create a new group, without the grid's timeout. Checked on 2.13.0.
    If it moves: `passes.mesh.Grid` fails at construction with an AttributeError naming it; without it clipping still
    works, with DTensor's warning about sequential all-reduces on every rank. torch 2.11 and 2.12 find a flattened mesh
    by its private `_layout` (`_get_slice_mesh_layout` of the dims it spans, coalesced): `flat` gets that layout there
    (checked on 2.11.0)."""
    mesh._get_root_mesh()._flatten_mapping[name] = flat
    if torch.torch_version.TorchVersion(torch.__version__) < (2, 13) and hasattr(mesh, "_get_slice_mesh_layout"):
        layout = mesh._get_slice_mesh_layout(tuple(mesh.mesh_dim_names)).coalesce()
        flat._layout = layout.nest() if len(layout) > 1 else layout


def dtensor_parts(dt) -> tuple:
    """(local tensor, DTensorSpec) of a DTensor: what `DTensor(local, spec, requires_grad=...)` takes to
    build a subclass instance over the same block without a copy. DTensor keeps them in the private
    `_local_tensor` and `_spec`. Checked on 2.13.0. If they move: `autopar.program.outputs.Output` (every split
    output of a ParallelModule) cannot be built."""
    return dt._local_tensor, dt._spec


@contextlib.contextmanager
def implicit_replication():
    """DTensor's switch that reads a plain-tensor operand as replicated, put back as it was afterwards
    (torch's public `torch.distributed.tensor.experimental.implicit_replication` sets the same private
    `DTensor._op_dispatcher._allow_implicit_replication`, but resets it to False on exit, which would end
    a user's own enclosing `implicit_replication()`). Checked on 2.13.0. If it moves: operations mixing
    an `autopar.program.outputs.Output` with a plain tensor fail with DTensor's mixed-tensor error."""
    from torch.distributed.tensor import DTensor

    dispatcher = DTensor._op_dispatcher
    was = dispatcher._allow_implicit_replication
    dispatcher._allow_implicit_replication = True
    try:
        yield
    finally:
        dispatcher._allow_implicit_replication = was


def peak_tensor_bytes(fn, device: torch.device) -> int:
    """Run fn() and return the peak bytes of the tensors it allocates on `device` that are alive at
    once (parameters, activations, gradients, optimizer states, temporaries), tracked by
    torch.distributed._tools.mem_tracker.MemTracker, which works on CPU where no allocator statistics
    exist. Checked on 2.13.0. If it moves: `autopar bench` cannot report peak memory per rank."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    with tracker:
        fn()
    return int(tracker.get_tracker_snapshot("peak").get(device, {}).get("Total", 0))


def dynamo_counts() -> tuple:
    """(graphs compiled, graph breaks) so far in this process, from dynamo's private counters
    (`torch._dynamo.utils.counters`: "stats"/"unique_graphs" and the "graph_break" reasons). Checked on
    2.13.0. If they move: `explain` cannot say how many graphs a compiled program became."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


def in_backward() -> bool:
    """True while autograd's engine runs a backward on this thread (`torch._C._current_graph_task_id`
    is -1 outside one). `autopar.parallel.sharded` counts FSDP2's all-gathers in backward (a block
    gathered again after `reshard_after_forward`) under the phase "bwd". Checked on 2.13.0. If it
    moves: every all-gather counts as "fwd" (the totals stay right)."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


def in_torch_compile_call() -> bool:
    """True while a module wrapped by the user's `torch.compile(module)` is being called (dynamo's
    OptimizedModule sets the private `torch._dynamo.eval_frame._in_optimized_module` around the call).
    A ParallelModule's orchestration runs outside dynamo (`torch.compiler.disable`) and compiles its
    per-rank program itself when this says so. Checked on 2.13.0. If it moves: False, and
    `torch.compile(pmodel)` runs the program eagerly, as a ParallelModule without compile=True does."""
    try:
        from torch._dynamo.eval_frame import _is_in_optimized_module
    except ImportError:
        return False
    return bool(_is_in_optimized_module())


def fx_graph_cache_counts() -> dict:
    """Inductor's FX graph cache events so far in this process ("hit", "miss", "bypass", ...), from
    dynamo's private counters (`torch._dynamo.utils.counters["inductor"]`, keys "fxgraph_cache_*").
    Checked on 2.13.0. If they move: `python -m autopar.bench.compile` cannot report cache hits."""
    from torch._dynamo.utils import counters

    return {k[len("fxgraph_cache_"):]: v for k, v in counters["inductor"].items() if k.startswith("fxgraph_cache_")}


def detect_fake_mode(tensors):
    """The FakeTensorMode the tensors belong to, or None (`torch._guards.detect_fake_mode`). Checked on
    2.13.0. If it moves: routing experts cannot run their shape probe inside export's fake mode."""
    from torch._guards import detect_fake_mode as detect

    return detect(tensors)


def grouped_mm(x, w, offs):
    """`torch._grouped_mm(x, w, offs=offs)`: one matmul per group of rows against its own weight, the
    kernel transformers' grouped experts call. Checked on 2.13.0. If it moves: the expert kernel on a
    rank's block fails on the aten path (transformers' own fallback still runs)."""
    return torch._grouped_mm(x, w, offs=offs)


def register_ordered(qualname: str) -> None:
    """Declare the torch.library op `qualname` ("namespace::name") side-effecting with torch's ORDERED effect:
    torch.compile then threads an effect token through every call of such ops (AOTAutograd's `with_effects`, forward
    and backward) and never drops one whose result is unused. Inductor 2.13 keeps the calls, and their order only with
    `keep_effect_order_in_inductor`. Eager calls are unchanged. `torch.library._register_effectful_op` and
    `torch._library.effects.EffectType` are private (what torch's own docs point to for ops with side effects). Checked
    on 2.13.0. If they move: `passes.ops.library` fails to import; without them a compiled program may drop a
    collective whose result it does not use, and ranks compiling different graphs (uneven blocks) then hang."""
    from torch._library.effects import EffectType

    torch.library._register_effectful_op(qualname, EffectType.ORDERED)  # 2.13 refuses a CustomOpDef here


_EFFECT_ORDER_MODULE = "torch._inductor.lowering"


def keep_effect_order_in_inductor() -> None:
    """Make inductor keep ORDERED-effectful ops (`register_ordered`) in program order.

    torch 2.13's lowering of `with_effects` (`torch._inductor.lowering.with_effects`) records the edge from each
    effectful op to the one before it in `V.graph.additional_star_deps`, keyed by the op's buffer name ("buf41"); the
    scheduler looks those edges up by operation name ("op41"), so none is ever found and inductor may reorder the ops.
    Two grid columns whose programs differ then launch their collectives in different orders and wait on each other for
    ever (seen in compiled generation). Upstream: pytorch/pytorch#189209, open when this was written. This wraps that
    lowering: after it runs, each edge filed under a buffer name is moved to the operation's name, in
    `additional_buffer_deps` (an ordering-only edge that does not keep the previous op's output alive, unlike a star
    dep). Where torch already files edges by operation name, nothing is found and nothing changes. Idempotent;
    `torch._inductor.lowering` is imported only by a compile (7 s here), so when it is not imported yet the wrap is
    installed by an import hook on its first import. Checked on 2.13.0. If `lowerings`, `V.graph.additional_star_deps`
    or `additional_buffer_deps` move: this raises at the first compile, naming the missing attribute."""
    if _EFFECT_ORDER_MODULE in sys.modules:
        _wrap_with_effects_lowering(sys.modules[_EFFECT_ORDER_MODULE])
    elif not any(isinstance(f, _EffectOrderFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _EffectOrderFinder())


def _wrap_with_effects_lowering(lowering) -> None:
    op = torch.ops.higher_order.with_effects
    original = getattr(lowering, "lowerings", {}).get(op)
    if original is None:
        raise TorchVersionError(
            f"autopar: torch {torch.__version__} has no inductor lowering `lowerings[with_effects]` in torch._inductor."
            f"lowering (checked on 2.13.0), so autopar cannot make compiled programs keep their collectives in order. "
            f"Use parallelize(..., compile=False), or a torch version autopar supports.")
    if getattr(original, "_autopar_effect_order", False):
        return
    from torch._inductor.virtualized import V

    def with_effects_in_order(*args, **kwargs):
        graph = V.graph
        before = len(graph.operations)
        out = original(*args, **kwargs)
        for new_op in graph.operations[before:]:
            buf, name = new_op.get_name(), new_op.get_operation_name()
            if buf != name and buf in graph.additional_star_deps:
                graph.additional_buffer_deps[name] |= graph.additional_star_deps.pop(buf)
        return out

    with_effects_in_order._autopar_effect_order = True  # type: ignore[attr-defined]
    lowering.lowerings[op] = with_effects_in_order


class _EffectOrderFinder:
    """A `sys.meta_path` finder that wraps the with_effects lowering when inductor's lowering module is
    first imported (`keep_effect_order_in_inductor`); it finds nothing itself."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _EFFECT_ORDER_MODULE:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = None if finder is self or find is None else find(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _WrapAfterExec(spec.loader)
                return spec
        return None


class _WrapAfterExec:
    """The loader of `torch._inductor.lowering`, wrapping the with_effects lowering once it has run."""

    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        _wrap_with_effects_lowering(module)


# torch._inductor.config.unsafe_marked_cacheable_functions: higher-order ops (by "module.name") that inductor's FX
# graph cache may keep, each with a value that enters the cache key. AOTAutograd wraps every ORDERED op
# (`register_ordered`) in the `with_effects` higher-order op, which torch does not mark cacheable: without this entry
# every graph calling an autopar collective is compiled again by each new process (a restarted job). The value names
# the effect-order wrap, so no graph compiled without it (`keep_effect_order_in_inductor`) is ever reused. Passed by
# `compile=True` (`passes.ops.library. INDUCTOR_OPTIONS`). Checked on 2.13.0. If it moves: torch.compile refuses the
# option at the first compile.
CACHEABLE_EFFECTS = {"torch.ops.higher_order.with_effects": f"{torch.__version__}+autopar-effect-order-1"}
