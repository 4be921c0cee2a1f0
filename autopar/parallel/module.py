"""`ParallelModule`, what `parallelize` returns: the per-rank graph wrapped in a module that behaves
like the original: same call signature, original parameter names (as DTensors), split outputs as
`autopar.program.outputs.Output` DTensors (a loss written for one process runs on them), replicated
ones as plain tensors. The passes themselves run in `autopar.program.build`, once per input
signature; `autopar.parallel.run` runs the programs."""

from __future__ import annotations

import contextlib

import sys
import types

import torch
import torch.distributed as dist
import torch.nn as nn
from passes.compat import in_torch_compile_call, pytree
from torch.distributed.tensor import DTensor, distribute_tensor

from passes import Grid
from passes.layout import local_shape
from passes.layout import REPLICATED, Layout
from passes.ops.grad_buckets import BucketPlan
from passes.options import Options
from autopar.parallel import hf_compat as hf_compat
from autopar.parallel.programs import ProgramCache
from autopar.parallel.replicas import replicas_for
from autopar.parallel.run import Runner
from autopar.parallel.clip import clip_grad_norm
from autopar.parallel.sharded import refuse_foreign_sharding
from autopar.program import context, outputs as outputs
from autopar.generate.loop import Generator, generate as generate_tokens
from autopar.parallel.inputs import RankStateDict, check_inputs as check_call_inputs, input_names, same_state_everywhere
from autopar.program.build import Compiled, cache_off_kwargs, refuse_kv_cache
from autopar.errors import NotMaterializedError, UsageError

__all__ = ["Local", "ParallelModule", "save_pretrained_extension", "set_path"]


def _shard(p: torch.Tensor, lay: Layout, grid: Grid, device) -> nn.Parameter:
    """The parameter as a DTensor holding this rank's block. A meta parameter gets an uninitialized
    block (to be filled by a checkpoint load); a real one is scattered from rank 0."""
    placements, mesh = list(lay.placements), grid.cube.mesh if len(lay.placements) == 3 else grid.mesh  # 3D: cube's
    if p.is_meta:
        block = local_shape(tuple(p.shape), lay, grid.shape, at=(grid.r, grid.c))  # torch.chunk block, as DTensor's
        local = torch.empty(block, dtype=p.dtype, device=device)
        dt = DTensor.from_local(local, mesh, placements, run_check=False, shape=p.shape, stride=p.stride())
    else:
        dt = distribute_tensor(p.detach().clone(), mesh, placements, src_data_rank=0)
    return nn.Parameter(dt, requires_grad=p.requires_grad)


def set_path(root: nn.Module, path: str, value, kind: str, persistent: bool = True) -> None:
    """`value` registered in `root` at `path` as a parameter (`kind` 'param') or buffer, with plain
    modules made on the way; a path through an attribute of `root` that is not a module is refused."""
    *mods, leaf = path.split(".")
    m = root
    for name in mods:
        if name not in dict(m.named_children()):
            if hasattr(m, name):
                raise UsageError(f"the model's {path!r} starts with {name!r}, which autopar's {type(root).__name__} "
                                 f"uses as an attribute; rename that module of the model")
            m.add_module(name, nn.Module())
        m = getattr(m, name)
    if kind == "param":
        m.register_parameter(leaf, value)
    else:
        m.register_buffer(leaf, value, persistent=persistent)


class Local:
    """`pm(Local(comp, flat))` is `pm.run_local(comp, flat)` through the module's call (its hooks: FSDP2's
    gathering of a sharded root)."""

    __slots__ = ("comp", "flat")

    def __init__(self, comp, flat: list):
        self.comp, self.flat = comp, flat


# methods a layer above adds (autopar.checkpoint: "save_pretrained"), so that this one imports none of it
EXTENSIONS: dict = {}


def save_pretrained_extension(model, path, **kwargs) -> None:
    """`autopar.save_pretrained(model, path, **kwargs)` as registered in EXTENSIONS (the method of
    ParallelModule and PipelineModule)."""
    save = EXTENSIONS.get("save_pretrained")
    if save is None:
        raise UsageError("pmodel.save_pretrained(path) is autopar.save_pretrained(pmodel, path), which is not "
                         "loaded yet: call autopar.save_pretrained(pmodel, path) (on every rank)")
    save(model, path, **kwargs)


class ParallelModule(nn.Module):
    """The 2D-parallel model on one rank. Call it like the original, on every rank, with the same
    full inputs. A call with new input shapes or a new train/eval mode is compiled once and cached."""

    def __init__(self, model: nn.Module, grid: Grid, first: Compiled, param_layouts: dict, options: Options):
        """`first`: the program compiled for parallelize's example inputs (its strategy='auto' choice,
        if any, is repeated by every later compile); `param_layouts`: its parameter layouts."""
        super().__init__()
        object.__setattr__(self, "_source", model)  # kept to capture new shapes / modes; not a child
        self.grid = grid
        self._options = options
        self._programs = ProgramCache(model, grid, options, first, param_layouts)
        self._runner = Runner(options.compile)
        self._via_torch_compile = False  # this call came through the user's torch.compile(pmodel)
        self.replicas = replicas_for(grid, options)  # the replica mode: shard_replicas makes it Sharded
        device = first.captured.device
        for name, p in model.named_parameters():
            set_path(self, name, _shard(p, param_layouts.get(name, REPLICATED), grid, device), "param")
        for name, b in first.captured.buffers.items():
            if b.is_meta:
                raise UsageError(
                    f"buffer {name!r} is on the meta device, so its values are unknown; build the model "
                    f"inside autopar.meta_init(), which puts only parameters on meta"
                )
            set_path(self, name, b.detach().clone(), "buffer", name in first.captured.persistent)
        self._persistent_buffers = set(first.captured.persistent)
        self._cache_off = cache_off_kwargs(model)  # use_cache=False for forwards that take it
        if grid.dp > 1:  # replicas start from replica 0's values, whatever each rank built
            for p in self.parameters():
                dist.broadcast(p.to_local().data, src=dist.get_global_rank(grid.dp_group, 0), group=grid.dp_group)
        self._materialized = not any(p.is_meta for p in model.parameters())
        first_name: dict = {}
        self._tied = {}  # other name of a tied parameter -> the name it is registered under
        for name, p in model.named_parameters(remove_duplicate=False):
            if first_name.setdefault(id(p), name) != name:
                self._tied[name] = first_name[id(p)]
        self.train(model.training)
        hf_compat.attach(self, model)  # Trainer and accelerate see the original model, tensor parallel

    @property
    def tp_size(self) -> int:
        """Ranks that share one batch (R*C), the tensor-parallel size transformers and accelerate read.
        Read by transformers' plain Trainer it raises, naming autopar's ParallelTrainer."""
        hf_compat.refuse_plain_trainer(sys._getframe(1))
        return self.grid.world

    _tp_size = tp_size

    @property
    def replica_sync(self) -> bool:
        """dp > 1 replicated: whether each backward averages the gradients over the replicas (a pipeline's
        stages turn it off and average once per step, after the schedule)."""
        return self.replicas.sync

    @replica_sync.setter
    def replica_sync(self, value: bool) -> None:
        self.replicas.sync = bool(value)

    @property
    def program(self) -> Compiled:
        """The compiled program (`autopar.program.build.Compiled`) of the most recent call; before the first
        call, the one compiled for parallelize's example inputs. For inspection (`explain`, benchmarks)."""
        return self._programs.last

    @property
    def graph_module(self) -> torch.fx.GraphModule:
        """The per-rank graph of `program` (for inspection): the most recent call's, or before the
        first call the one compiled for parallelize's example inputs."""
        return self._programs.last.gm

    @property
    def source_model(self) -> nn.Module:
        """The model this was built from (unchanged, not a child module): new shapes and modes are
        captured from it, and checkpoints read its config and tied names."""
        return self._source

    def save_pretrained(self, path, **kwargs) -> None:
        """`autopar.save_pretrained(self, path, **kwargs)` (registered in `EXTENSIONS` by autopar.checkpoint),
        under the name transformers and peft models give it: call it on every rank."""
        save_pretrained_extension(self, path, **kwargs)

    @property
    def tied_names(self) -> dict:
        """The other name of each tied parameter -> the name it is registered under (an LM head tied to
        the token embedding: {'head.weight': 'tok.weight'})."""
        return dict(self._tied)

    def state_dict(self, *args, **kwargs):
        """As nn.Module's: this rank's blocks, as DTensors (what torch.distributed.checkpoint and the
        optimizers read). Saved with torch.save it holds this rank's blocks only and loads only into the
        same grid, so pickling it warns, naming the calls that write full tensors."""
        return RankStateDict.of(super().state_dict(*args, **kwargs))

    @property
    def persistent_buffer_names(self) -> frozenset:
        """Names of the buffers a state_dict (and a checkpoint) holds: the model's persistent ones."""
        return frozenset(self._persistent_buffers)

    @property
    def materialized(self) -> bool:
        """Whether the parameter blocks hold values: False after parallelizing a model built on the meta
        device (a call then raises) until a load fills every block and sets it (load_state_dict,
        autopar.load_safetensors, autopar.load_distributed)."""
        return self._materialized

    @materialized.setter
    def materialized(self, value: bool) -> None:
        self._materialized = bool(value)

    @property
    def options(self) -> Options:
        """The options parallelize was given (`passes.options.Options`, frozen)."""
        return self._options

    @property
    def param_layouts(self) -> types.MappingProxyType:
        """Parameter name -> the Layout its blocks are stored in (read-only): every later compile keeps it."""
        return types.MappingProxyType(self._programs.param_layouts)

    @property
    def programs(self) -> types.MappingProxyType:
        """Input signature -> Compiled, every program compiled so far (read-only), parallelize's first."""
        return self._programs.view

    @property
    def choice(self):
        """strategy='auto': the search's Choice (`passes.search.strategy.Choice`), which every later
        compile (new shapes, a generation phase following the forward's plan) repeats; else None."""
        return self._programs.first.choice

    @property
    def compile_stats(self) -> dict:
        """compile=True: input signature -> CompileStats of the program's first compiled call."""
        return self._runner.stats

    @property
    def generator(self) -> Generator:
        """The generation programs and KV cache of `generate` (`autopar.generate.loop.Generator`), built
        on first use."""
        if "_gen" not in self.__dict__:
            self.__dict__["_gen"] = Generator(self)
        return self.__dict__["_gen"]

    def run_program(self, comp: Compiled, locals_: list):
        """comp's graph on `locals_` (this rank's blocks and inputs, in `comp.captured.sources` order),
        with compile=True under torch.compile (compiled on first use): how `generate` runs its programs."""
        return self._runner(comp, locals_)

    @contextlib.contextmanager
    def observing(self, observer, eager: bool = False):
        """Within: each eager call of a program runs as `observer(gm, args)` (which returns gm's outputs)
        instead of `gm(*args)`; compiled programs run as they are, or with `eager` eagerly through the
        observer too. `autopar.debug.verify` records every node's value this way."""
        runner = self._runner
        was = runner.observer, runner.observe_compiled
        runner.observer, runner.observe_compiled = observer, eager
        try:
            yield
        finally:
            runner.observer, runner.observe_compiled = was

    def _get(self, args, kwargs):
        return self._programs.get(args, kwargs, self.training, lambda name: self.get_parameter(name).shape)

    def check_parameters(self, comp: Compiled, args, kwargs) -> None:
        """A recompile keeps every parameter's stored layout (pinned); what it cannot keep is a parameter
        that is new or has another shape than when the model was parallelized (`ProgramCache`)."""
        self._programs.check_parameters(comp, args, kwargs, lambda name: self.get_parameter(name).shape)

    @torch.compiler.disable
    def _wrapped_call_impl(self, *args, **kwargs):
        """As nn.Module's call (hooks included), never traced by dynamo: under the user's
        torch.compile(pmodel) the Python around the program (caches, checks, output wrapping) would
        break its graph several times and recompile on guards over this module's state. The program
        itself is what gets compiled: a call through torch.compile(pmodel) runs it as compile=True
        does (one graph per rank, compiled on the first call of each input signature).

        The name is nn.Module's own: torch.compile(module) runs a top-level function of another name
        that dynamo does not trace through a traced wrapper, which then counts a graph break at the
        call (checked on 2.13.0); under this name it calls it directly and traces nothing."""
        self._via_torch_compile = in_torch_compile_call()
        return super()._wrapped_call_impl(*args, **kwargs)

    __call__ = _wrapped_call_impl

    def compile(self, *args, **kwargs) -> None:
        """In place, as nn.Module.compile: from now on every call runs its program compiled, as with
        parallelize(..., compile=True) (the per-rank program is what torch.compile sees; `args` and
        `kwargs`, torch.compile's options, are not applied to it: it compiles with inductor)."""
        self._runner.compile = True

    def forward(self, *args, **kwargs):
        if not self._materialized:
            raise NotMaterializedError(
                "this model was parallelized from the meta device and its parameter blocks hold no values "
                "yet: load them with autopar.load_safetensors(pmodel, path) or torch.distributed.checkpoint, "
                "or build it with autopar.from_pretrained(path, ...)"
            )
        if len(args) == 1 and isinstance(args[0], Local):  # a pipeline stage: through the call, for FSDP2's hooks
            return self.run_local(args[0].comp, args[0].flat)
        refuse_kv_cache(kwargs)
        refuse_foreign_sharding(self)
        kwargs = {**self._cache_off, **kwargs}
        if self.grid.cp > 1:  # each rank's part of the sequence in, the whole outputs out (autopar.program.context)
            local_args, local_kwargs = context.local_call(self.grid, args, kwargs)
            comp, flat = self._get(local_args, local_kwargs)
            flat, full, wholes = context.local_inputs(comp, self.grid, flat, args, kwargs)
            self._validate_inputs(flat, comp, lambda: input_names(comp, local_args, local_kwargs))
            context.same_batch(self.grid, full, comp.captured.device, self._options.check_inputs)
            leaves, layouts = context.gather_outputs(comp, self.grid, self.run_local(comp, flat), wholes)
            return self.outputs_of(comp, leaves, layouts)
        comp, flat = self._get(args, kwargs)
        self._validate_inputs(flat, comp, lambda: input_names(comp, args, kwargs))
        return self.outputs_of(comp, self.run_local(comp, flat))

    def run_local(self, comp: Compiled, flat: list) -> list:
        """comp's program on this rank's blocks and `flat` (its user inputs in placeholder order, each whole,
        or this rank's block where its placeholder is `PLACED`), unchecked; returns its output leaves as
        this rank's blocks of `comp.out_layouts`. What a call runs after its checks; a pipeline stage's way in."""
        self._programs.last = comp
        run, fetched = self.replicas.program(comp)  # sharded replicas: blocks as calls of their FSDP2 units
        with self.replicas.around(comp, run):
            return pytree.tree_leaves(self._run_program(comp, run, fetched, flat))

    def outputs_of(self, comp: Compiled, leaves: list, layouts: list | None = None):
        """What a call returns from `run_local`'s leaves: split ones as Output DTensors, in the model's structure.
        `layouts`: each leaf's (layout, global shape), when not `comp.out_layouts`."""
        wrapped = [self._wrap(o, lay) for o, lay in zip(leaves, layouts or comp.out_layouts)]
        return pytree.tree_unflatten(wrapped, comp.captured.out_spec)

    def _run_program(self, comp: Compiled, run: Compiled, fetched: frozenset, flat: list):
        """`run` (comp's program, or with sharded replicas its version with block calls, which fetch the
        parameters in `fetched` themselves) on this rank's blocks and the flat inputs."""
        locals_, cache = [], {}
        for role, key in comp.captured.sources:
            if role == "param" and key not in cache:
                cache[key] = None if key in fetched else self.get_parameter(key).to_local()
        step = self.replicas.step(comp, self, cache)  # replicated: gradient buckets averaged during backward
        for role, key in comp.captured.sources:
            if role == "param":
                locals_.append(cache[key])
            elif role == "buffer":
                locals_.append(self.get_buffer(key))
            elif role == "constant":
                locals_.append(comp.captured.constants[key])
            else:
                locals_.append(flat[key])
        compile, self._via_torch_compile = self._via_torch_compile, False
        if comp.random and self.training:
            return self._runner.with_rank_rng(run, locals_, self.grid.rank, step, compile)
        return self._runner(run, locals_, step, compile)

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs):
        """Generate from a causal LM as transformers' `model.generate` does (greedy or sampling:
        max_new_tokens, do_sample, temperature, top_k, top_p, eos_token_id, pad_token_id,
        return_dict_in_generate, ...), on every rank with the same inputs; returns the sequences
        [B, prompt + new] (or a GenerateDecoderOnlyOutput), the same on every rank. A left-padded batch
        passes its attention_mask. `max_cache_len`: the KV cache slots to prepare (default: the request
        rounded up to a multiple of 64). The cache is split over the grid (batch over rows, KV heads
        over columns); a prefill and a decode program are compiled once per (batch, cache length) and
        reused (see `autopar.generate`). `prefill_strategy` / `decode_strategy`: None (follow the
        model: strategy='auto' searches each phase's plan, '2d' and '1d' keep the forward's),
        'forward' (the forward's plan), '2d', '1d' or 'auto' to plan that phase on its own (see
        `autopar.generate.phases`). Runs under torch.no_grad(). With data_parallel='shard' the grid
        blocks are gathered over the replicas for the call and released after it. With context_parallel
        each cp copy of the grid generates the whole sequence (its KV cache whole along the sequence, split
        over its grid; not split over the cp ranks), all from the same inputs: greedy decoding gives the same
        tokens on every copy; sampling draws per copy, as replicas do."""
        with self.replicas.generating():  # sharded: FSDP2's units gathered over the replicas for the call
            return generate_tokens(self, input_ids, attention_mask, **kwargs)

    def check_inputs(self, *args, **kwargs) -> None:
        """What every call checks first, on its own: that these inputs are on this rank's device and that
        every rank of the grid passed the same (values too, unless check_inputs=False); raises a
        UsageError naming the input and the ranks that differ. Call it on every rank, like a call."""
        kwargs = {**self._cache_off, **kwargs}
        comp, flat = self._get(args, kwargs)
        self._validate_inputs(flat, comp, lambda: input_names(comp, args, kwargs))

    def _validate_inputs(self, flat, comp, names) -> None:
        check_call_inputs(self.grid, flat, comp.captured.device, names, self._options)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """As nn.Module's, and also from plain full tensors (a single-process model's state_dict, the
        same on every rank): each rank keeps its block of each. Call it on every rank of the grid: one
        all-gather of a checksum per full tensor checks that the ranks were given the same values."""
        own = self.state_dict()
        same_state_everywhere(self.grid, state_dict, own, self._tied)
        converted = {}
        for name, value in state_dict.items():
            name = self._tied.get(name, name)  # a tied weight's other name (an LM head) loads once
            if name in converted:
                continue
            mine = own.get(name)
            if isinstance(mine, DTensor) and isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
                if tuple(value.shape) != tuple(mine.shape):
                    raise UsageError(
                        f"load_state_dict: {name!r} has shape {tuple(value.shape)}, the model's parameter is "
                        f"{tuple(mine.shape)}; load a state_dict of the same architecture and sizes"
                    )
                value = distribute_tensor(value.detach().to(device=mine.device, dtype=mine.dtype), mine.device_mesh,
                                          mine.placements, src_data_rank=None)  # local slicing: inputs agree
            converted[name] = value
        result = super().load_state_dict(converted, strict=strict, assign=assign)
        self._materialized = True
        return result

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients of every parameter to a total norm of `max_norm`, as
        torch.nn.utils.clip_grad_norm_ does on one process; returns the total norm (a plain tensor,
        equal on every rank). Each block is counted once: a block replicated over a mesh axis counts on
        member 0 of that axis only. One all-reduce of one number over the grid (over every rank with
        data_parallel='shard'), bounded by `timeout` (replicated replicas hold the same averaged
        gradients and compute the same norm). Unlike torch's function on DTensors it does not warn
        about sequential all-reduces."""
        return clip_grad_norm(self, max_norm, norm_type)

    def replica_traffic(self):
        """With data_parallel='shard': what FSDP2 moves over the replicas per rank and training step
        (`passes.cost.replicas.FSDPTraffic`); None otherwise."""
        return self.replicas.traffic()

    def grad_bucket_plan(self, comp=None) -> BucketPlan:
        """With grid=(d, R, C), d > 1: how the gradients of `comp` (default: the latest program) are
        averaged over the replicas, one all-reduce per bucket (`passes.ops.grad_buckets`)."""
        return self.replicas.bucket_plan(comp or self.program, self)

    def _wrap(self, out, lay_shape):
        if lay_shape is None or not isinstance(out, torch.Tensor):
            return out
        lay, shape = lay_shape
        if lay.is_replicated:
            return out
        return outputs.wrap(out, self.grid, lay.placements, shape)
