"""`parallelize`: run the passes and wrap the per-rank graph in a module that behaves like the
original: same call signature, original parameter names (as DTensors), split outputs as
`autopar.program.outputs.Output` DTensors (a loss written for one process runs on them), replicated ones as
plain tensors. The passes themselves run in `autopar.program.build`, once per input signature."""

from __future__ import annotations

import datetime
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn
from passes.compat import dynamo_counts, pytree
from torch.distributed.tensor import DTensor, distribute_tensor

from passes import Grid
from passes.capture.export import flatten_inputs
from passes.layout import local_shape
from passes.layout import REPLICATED, Layout
from passes.ops import comm
from passes.ops.grad_buckets import BucketPlan, BucketReduce, StepBuckets, with_arrivals
from passes.mesh import warn
from passes.meta import PARAM
from passes.ops.library import INDUCTOR_OPTIONS
from passes.options import DEFAULTS, Options
from autopar.parallel import hf_compat as hf_compat
from autopar.program import outputs as outputs
from autopar.generate.loop import Generator, generate as generate_tokens
from autopar.program.guards import agree_on_options, agree_on_plan, check_dtypes, fingerprint
from autopar.program.build import (Compiled, FallbackWarning, cache_off_kwargs, compile_program, input_device,
                              refuse_kv_cache, signature)
from autopar.errors import CompileWarning, NoProcessGroupError, NotMaterializedError, UnsupportedError, UsageError

__all__ = ["parallelize", "ParallelModule", "FallbackWarning", "CompileWarning"]


class CompileStats(NamedTuple):
    """What dynamo made of one program under parallelize(..., compile=True): the graphs it compiled
    and the graph breaks between them (0 when every kernel and collective traced)."""
    graphs: int
    breaks: int



def _shard(p: torch.Tensor, lay: Layout, grid: Grid, device) -> nn.Parameter:
    """The parameter as a DTensor holding this rank's block. A meta parameter gets an uninitialized
    block (to be filled by a checkpoint load); a real one is scattered from rank 0."""
    placements = list(lay.placements)
    if p.is_meta:
        block = local_shape(tuple(p.shape), lay, grid.shape, at=(grid.r, grid.c))  # torch.chunk block, as DTensor's
        local = torch.empty(block, dtype=p.dtype, device=device)
        dt = DTensor.from_local(local, grid.mesh, placements, run_check=False, shape=p.shape, stride=p.stride())
    else:
        dt = distribute_tensor(p.detach().clone(), grid.mesh, placements, src_data_rank=0)
    return nn.Parameter(dt, requires_grad=p.requires_grad)


def _set_path(root: nn.Module, path: str, value, kind: str, persistent: bool = True) -> None:
    *mods, leaf = path.split(".")
    m = root
    for name in mods:
        if not hasattr(m, name):
            m.add_module(name, nn.Module())
        m = getattr(m, name)
    if kind == "param":
        m.register_parameter(leaf, value)
    else:
        m.register_buffer(leaf, value, persistent=persistent)


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
        self._param_layouts = param_layouts
        self._compiled = {first.signature: first}
        self._runners: dict = {}  # signature -> the callable running that program (torch.compile'd if asked)
        self.compile_stats: dict = {}  # signature -> CompileStats of its first compiled call (compile=True)
        self._bucket_plans: dict = {}  # signature -> BucketPlan of the replicas' gradients (dp > 1)
        self._arrival_programs: dict = {}  # signature -> the eager program with its buckets' Arrive calls
        self._last = first
        device = first.captured.device
        for name, p in model.named_parameters():
            _set_path(self, name, _shard(p, param_layouts.get(name, REPLICATED), grid, device), "param")
        for name, b in first.captured.buffers.items():
            if b.is_meta:
                raise UsageError(
                    f"buffer {name!r} is on the meta device, so its values are unknown; build the model "
                    f"inside autopar.meta_init(), which puts only parameters on meta"
                )
            _set_path(self, name, b.detach().clone(), "buffer", name in first.captured.persistent)
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
        """Ranks that share one batch (R*C), the tensor-parallel size transformers and accelerate read."""
        return self.grid.world

    _tp_size = tp_size

    @property
    def program(self) -> Compiled:
        """The compiled program (`autopar.program.build.Compiled`) of the most recent call; before the first
        call, the one compiled for parallelize's example inputs. For inspection (`explain`, benchmarks)."""
        return self._last

    @property
    def graph_module(self) -> torch.fx.GraphModule:
        """The per-rank graph of `program` (for inspection): the most recent call's, or before the
        first call the one compiled for parallelize's example inputs."""
        return self._last.gm

    @property
    def source_model(self) -> nn.Module:
        """The model this was built from (unchanged, not a child module): new shapes and modes are
        captured from it, and checkpoints read its config and tied names."""
        return self._source

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

    def _get(self, args, kwargs):
        key = signature(args, kwargs, self.training)
        first = next(iter(self._compiled.values()))
        if key not in self._compiled:  # a cached key already matched the dtypes of its compile
            same = next((c for k, c in self._compiled.items() if k[1] == key[1]), None)  # same keywords
            if same is not None:
                check_dtypes(same, flatten_inputs(same.captured, args, kwargs))
            model = self._source
            was = model.training
            model.train(self.training)
            try:
                comp, _ = compile_program(model, args, kwargs, self.grid, self._options, first.choice,
                                          pinned=self._param_layouts)
            finally:
                model.train(was)
            self._check_parameters(comp, args, kwargs)
            self._compiled[key] = comp
        comp = self._compiled[key]
        return comp, flatten_inputs(comp.captured, args, kwargs)

    def _check_parameters(self, comp: Compiled, args, kwargs) -> None:
        """A recompile keeps every parameter's stored layout (pinned); what it cannot keep is a parameter
        that is new or has another shape than when the model was parallelized."""
        for node in comp.captured.gm.graph.nodes:
            name = node.meta.get(PARAM)
            if name is None or not isinstance(node.meta.get("val"), torch.Tensor):
                continue
            now = tuple(node.meta["val"].shape)
            was = tuple(self.get_parameter(name).shape) if name in self._param_layouts else None
            if now != was:
                shapes = [tuple(t.shape) for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
                raise UnsupportedError(
                    f"parameter {name!r} has shape {now} in a call with input shapes {shapes}, but "
                    + (f"shape {was} when the model was parallelized" if was else "did not exist when the model "
                       "was parallelized (a parameter created during a call)")
                    + "; its stored blocks cannot serve this call. Give it its final shape before parallelize "
                    "(run one call of the original model first), or call with the shapes it was parallelized for"
                )

    def forward(self, *args, **kwargs):
        if not self._materialized:
            raise NotMaterializedError(
                "this model was parallelized from the meta device and its parameter blocks hold no values "
                "yet: load them with autopar.load_safetensors(pmodel, path) or torch.distributed.checkpoint, "
                "or build it with autopar.from_pretrained(path, ...)"
            )
        refuse_kv_cache(kwargs)
        kwargs = {**self._cache_off, **kwargs}
        comp, flat = self._get(args, kwargs)
        self._last = comp
        self._validate_inputs(flat, comp)
        locals_, cache = [], {}
        for role, key in comp.captured.sources:
            if role == "param" and key not in cache:
                cache[key] = self.get_parameter(key).to_local()
        step = self._replica_buckets(comp, cache) if self.grid.dp > 1 and torch.is_grad_enabled() else None
        for role, key in comp.captured.sources:
            if role == "param":
                locals_.append(cache[key])
            elif role == "buffer":
                locals_.append(self.get_buffer(key))
            elif role == "constant":
                locals_.append(comp.captured.constants[key])
            else:
                locals_.append(flat[key])
        if comp.random and self.training:
            outs = self._run_with_rank_rng(comp, locals_, step)
        else:
            outs = self._run(comp, locals_, step)
        wrapped = [self._wrap(o, lay) for o, lay in zip(pytree.tree_leaves(outs), comp.out_layouts)]
        return pytree.tree_unflatten(wrapped, comp.captured.out_spec)

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
        `autopar.generate.phases`). Runs under torch.no_grad()."""
        return generate_tokens(self, input_ids, attention_mask, **kwargs)

    @property
    def _generator(self) -> Generator:
        if "_gen" not in self.__dict__:
            self.__dict__["_gen"] = Generator(self)
        return self.__dict__["_gen"]

    def _validate_inputs(self, flat, comp) -> None:
        device = comp.captured.device
        for i, t in enumerate(flat):
            if isinstance(t, torch.Tensor) and t.device != device:
                raise UsageError(
                    f"input {i} (shape {tuple(t.shape)}) is on {t.device}, but this rank's parameter blocks are "
                    f"on {device}; pass every input on {device} (the model was parallelized with inputs there)"
                )
        if not self._options.check_inputs:
            return
        mine = [fingerprint(t) for t in flat]
        everyone = [None] * self.grid.world
        with comm.guarded(self.grid, "check_inputs all-gather", "grid", "check_inputs"):
            dist.all_gather_object(everyone, mine, group=self.grid.world_group)
        base = self.grid.dp_index * self.grid.world
        for i in range(len(flat)):
            differ = [base + r for r, s in enumerate(everyone) if s[i] != everyone[0][i]]
            if differ:
                raise UsageError(
                    f"check_inputs: input {i} differs between ranks of this grid (rank {base} vs ranks {differ}); "
                    f"every rank of a grid must pass the same full inputs (shard the data per data-parallel "
                    f"replica, not per rank)"
                )

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """As nn.Module's, and also from plain full tensors (a single-process model's state_dict, the
        same on every rank): each rank keeps its block of each, without communication."""
        own = self.state_dict()
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
        member 0 of that axis only. One all-reduce of one number over the grid, bounded by `timeout`
        (data-parallel replicas hold the same averaged gradients and compute the same norm). Unlike
        torch's function on DTensors it does not warn about sequential all-reduces."""
        norm_type = float(norm_type)
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        if not grads:
            return torch.tensor(0.0)
        local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
        counted = [self._counts_here(g) for g in grads]
        dev = local[0].device
        if norm_type == float("inf"):
            part = torch.stack([t.detach().abs().max().float() if c and t.numel() else torch.zeros((), device=dev)
                                for t, c in zip(local, counted)]).max()
            op = dist.ReduceOp.MAX
        else:
            part = torch.stack([t.detach().float().abs().pow(norm_type).sum() if c else torch.zeros((), device=dev)
                                for t, c in zip(local, counted)]).sum().double()
            op = dist.ReduceOp.SUM
        with comm.guarded(self.grid, "all-reduce", "grid", "clip_grad_norm_"):
            dist.all_reduce(part, op=op, group=self.grid.world_group)
        total = part if norm_type == float("inf") else part.pow(1.0 / norm_type)
        total = total.float()
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for t in local:
            t.detach().mul_(coef.to(t.dtype))
        return total

    def _counts_here(self, g) -> bool:
        if not isinstance(g, DTensor):
            return self.grid.r == 0 and self.grid.c == 0
        for axis, p in enumerate(g.placements):
            if not p.is_shard() and self.grid.index(axis) != 0:
                return False
        return True

    def grad_bucket_plan(self, comp=None) -> BucketPlan:
        """With grid=(d, R, C), d > 1: how the gradients of `comp` (default: the latest program) are
        averaged over the replicas, one all-reduce per bucket (`passes.ops.grad_buckets`)."""
        comp = comp or self.program
        plan = self._bucket_plans.get(comp.signature)
        if plan is None:
            blocks = {n: p.to_local() for n, p in self.named_parameters() if p.requires_grad}
            plan = self._bucket_plans[comp.signature] = BucketPlan.build(
                comp.gm, comp.captured.sources, blocks, self._options.grad_bucket_mb * 2**20)
        return plan

    def _replica_buckets(self, comp, blocks: dict) -> StepBuckets | None:
        """This step's replica gradient buckets, the parameter blocks in `blocks` (name -> block)
        replaced by their bucketed twins; None when no block needs a gradient."""
        plan = self.grad_bucket_plan(comp)
        if not plan.buckets:
            return None
        step = StepBuckets(plan, self.grid, blocks[plan.keys[0]].device)
        for b, slots in enumerate(plan.buckets):
            outs = BucketReduce.apply(step, b, *(blocks[plan.keys[s]] for s in slots))
            blocks.update((plan.keys[s], o) for s, o in zip(slots, outs))
        return step

    def _run_with_rank_rng(self, comp, locals_, step=None):
        """Dropout masks independent per block: one number drawn from the default generator (equal on
        ranks seeded alike, so the user's RNG advances the same everywhere) seeds this rank's stream."""
        seed = int(torch.randint(0, 2**62, (1,)).item())
        devices = [comp.captured.device] if comp.captured.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed((seed + 1_000_003 * (self.grid.rank + 1)) % 2**63)
            return self._run(comp, locals_, step)

    def _run(self, comp, locals_, step=None):
        """comp's graph on this rank's blocks; with compile=True under torch.compile (compiled on first
        use, per signature). A program torch.compile cannot compile runs eagerly from then on, with one
        CompileWarning shown by rank 0 (`passes.mesh.warn`): every rank compiles the same program, so all
        of them fail and fall back alike. `step`: the replicas' gradient buckets; an eager program then
        runs with their `Arrive` calls, which launch each bucket's all-reduce during backward."""
        runner = self._runners.get(comp.signature)
        if step is not None and runner is comp.gm:
            return self._with_arrivals(comp)(*locals_, step)
        if runner is not None:
            return runner(*locals_)
        if not self._options.compile:
            self._runners[comp.signature] = comp.gm
            return self._run(comp, locals_, step)
        compiled = torch.compile(comp.gm, options=INDUCTOR_OPTIONS)  # order kept: compat.keep_effect_order_in_inductor
        before = dynamo_counts()
        try:
            outs = compiled(*locals_)
        except comm.CollectiveError:
            raise
        except Exception as e:  # a dynamo / inductor failure: this program runs eagerly
            first = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
            warn(f"autopar: torch.compile could not compile this program ({type(e).__name__}: {first}); it runs "
                 f"eagerly", CompileWarning, stacklevel=4)
            self._runners[comp.signature] = comp.gm
            return comp.gm(*locals_)
        self._runners[comp.signature] = compiled
        after = dynamo_counts()
        self.compile_stats[comp.signature] = CompileStats(after[0] - before[0], after[1] - before[1])
        return outs

    def _with_arrivals(self, comp):
        gm = self._arrival_programs.get(comp.signature)
        if gm is None:
            gm = self._arrival_programs[comp.signature] = with_arrivals(comp.gm, self.grad_bucket_plan(comp))
        return gm

    def _wrap(self, out, lay_shape):
        if lay_shape is None or not isinstance(out, torch.Tensor):
            return out
        lay, shape = lay_shape
        if lay.is_replicated:
            return out
        return outputs.wrap(out, self.grid, lay.placements, shape)


def parallelize(model: nn.Module, grid=(2, 2), example_inputs=(), example_kwargs=None, *,
                lowering: str = DEFAULTS.lowering, indivisible: str = DEFAULTS.indivisible,
                fused: str = DEFAULTS.fused, on_unsupported: str = DEFAULTS.on_unsupported,
                timeout: float | None = DEFAULTS.timeout, check_inputs: bool = DEFAULTS.check_inputs,
                strategy: str = DEFAULTS.strategy, cost_model=DEFAULTS.cost_model,
                memory_limit: float | None = DEFAULTS.memory_limit,
                search_budget: float | None = DEFAULTS.search_budget,
                compile: bool = DEFAULTS.compile, recompute: str | bool | None = DEFAULTS.recompute,
                grad_bucket_mb: float = DEFAULTS.grad_bucket_mb,
                moe_dispatch: str = DEFAULTS.moe_dispatch) -> ParallelModule:
    """Compile `model` for tensor parallelism on an R x C grid; call on every rank.

    Args:
        model: an unmodified nn.Module (it is not changed; its weights are copied into shards).
        grid: (R, C), e.g. (2, 2) or (2, 4); R*C must equal the world size of the default process
            group. Activations split batch over the R rows and hidden over the C columns. (dp, R, C)
            runs dp data-parallel replicas of the grid.
        strategy: how each weight matmul is split. '2d' (default): SUMMA on the grid. '1d':
            Megatron-style column/row splits over the C columns (batch over the R rows; on a (1, p)
            grid this is plain 1D tensor parallelism). 'auto': per matmul group (q|k|v, gate|up, one
            projection, an embedding) the option among 2d / 1d / replicated with the smallest
            estimated step time whose per-rank memory fits `memory_limit` (see passes/search/strategy.py and
            `explain`, which shows each choice against its alternatives).
        cost_model: for strategy='auto': the JSON path (or dict) `autopar calibrate` wrote, or None
            for published GPU-cluster figures (NVLink inside a node, InfiniBand across nodes).
        memory_limit: for strategy='auto': bytes per rank (parameters, gradients, Adam states and
            activations, estimated); None: no limit.
        search_budget: for strategy='auto': seconds the search may take (default 30) before it stops
            with the best plan found so far and a SearchWarning; None: no limit. Rank 0 searches and
            sends its choice to the other ranks.
        example_inputs / example_kwargs: one call's inputs, used to capture the graph.
        lowering: 'broadcast' (the paper's stepwise SUMMA) or 'allgather' (gather panels, one matmul;
            linears that read the same activation, q|k|v and gate|up, then share one set of calls and
            x's panel: `passes.transforms.group_siblings`).
        indivisible: a dim the grid does not divide (a vocabulary of 50257, 25 heads on 8 columns).
            'uneven' (default) splits it in torch.chunk blocks, as DTensor's Shard does (ceil(n/q)
            per member, the last shorter; nothing padded, state_dict and checkpoints keep the true
            shapes) where the rule can: vocabularies (embedding, LM head, cross-entropy), matmul
            out-features, attention heads, elementwise ops and views that keep the dim; a matmul whose
            in-features the grid does not divide still runs unsplit. 'replicate' runs every such matmul
            unsplit on every rank, with a FallbackWarning; 'error' raises a ShardingError instead.
        fused: how a fused projection's weight (output split into q|k|v or gate|up) is stored.
            'regroup' (default): as ordinary blocks, regrouped in the graph each step so each column
            block holds matching parts (one all-gather of the weight block per use, forward and
            backward); every parameter stays a plain sharded DTensor. 'interleave': stored interleaved
            (DTensor _StridedShard), no regrouping; torch.distributed.checkpoint cannot save such
            parameters in torch 2.13 (save_pretrained can).
        on_unsupported: 'replicate' (default) runs an op that has no split form whole on every rank
            (gathering its inputs) with a FallbackWarning; 'error' raises instead, naming the op, the
            node, the module path and the source line. Fallbacks whose inputs are already whole (mask
            and position-id construction) cost nothing and are allowed either way.
        timeout: seconds after which every collective of a step gives up with a CollectiveError (a peer
            rank died or is stuck): autopar's own, check_inputs, pm.clip_grad_norm_, checkpoint gathers,
            and DTensor's (the mesh is built on process groups with this timeout, so torch's
            clip_grad_norm_ and full_tensor() are bounded too, raising torch's error). Default: the
            process group's timeout. parallelize's two start-up handshakes (options, plan) always wait up
            to the process group's timeout, since ranks compile at different speeds.
        check_inputs: verify on every call that all ranks of a grid passed the same inputs (one small
            all-gather per call); off by default.
        compile: run each rank's program under torch.compile (inductor), compiled on the first call of
            each input signature; the collectives run between the compiled regions. The same as calling
            torch.compile(pmodel). A program torch.compile cannot compile runs eagerly, with one
            CompileWarning.
        recompute: activation recomputation (`passes.transforms.recompute`). None (default): autograd keeps every
            activation backward needs. 'blocks': each repeated block (`model.layers.3`, `transformer.h.3`)
            keeps only its inputs and runs again in backward, its SUMMA broadcasts included (counted in
            `plan(...).recompute_bytes`). 'selective': matmul, attention and communication outputs are
            kept and the local ops between them (pointwise, norm statistics, softmax) recomputed; no byte
            is communicated twice. Dropout draws the same masks when recomputed. With strategy='auto' and
            a memory_limit, None lets the search recompute the fewest blocks that make the plan fit;
            False never recomputes.
        grad_bucket_mb: with grid=(dp, R, C), dp > 1: the parameter gradients are averaged over the
            replicas in buckets of at most this many MiB, one all-reduce each (default 25; 0: one per
            parameter block). Eagerly, each bucket's all-reduce starts during backward as soon as its
            gradients are complete and is waited for at the end of backward; see
            `passes.ops.grad_buckets` and `pmodel.grad_bucket_plan()`.
        moe_dispatch: how a mixture of experts' routed tokens reach their experts (split over the
            grid rows). 'all_to_all': each row keeps its tokens and sends each routed token's hidden
            block to its expert's row and back (expert parallelism); 'gather': every row gathers
            all the routed tokens; 'auto' (default): all-to-all when the grid has more than one row.
    """
    options = Options(lowering=lowering, indivisible=indivisible, fused=fused, on_unsupported=on_unsupported,
                      strategy=strategy, cost_model=cost_model, memory_limit=memory_limit,
                      search_budget=search_budget, check_inputs=check_inputs, timeout=timeout,
                      compile=compile, recompute=recompute, grad_bucket_mb=grad_bucket_mb,
                      moe_dispatch=moe_dispatch)
    if not (isinstance(grid, (tuple, list)) and len(grid) in (2, 3)
            and all(isinstance(g, int) and not isinstance(g, bool) for g in grid)):
        raise UsageError(f"grid={grid!r}: expected (R, C) of positive ints, e.g. grid=(2, 2) or (2, 4), or "
                         f"(dp, R, C) for dp data-parallel replicas of an R x C grid")
    if not torch.distributed.is_initialized():
        raise NoProcessGroupError(
            "autopar.parallelize needs torch.distributed: call torch.distributed.init_process_group "
            "(backend 'gloo' on CPU, 'nccl' on GPUs) on every rank first, or use autopar.launch.spawn"
        )
    if not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,)
    device = input_device(example_inputs, example_kwargs)  # the mesh lives where the inputs do
    # parallelize's own two handshakes wait up to the process group's timeout, not `timeout`: ranks
    # capture and plan at different speeds (seconds apart on a loaded machine, more with strategy='auto')
    agree_on_options(tuple(grid), options, device.type)
    delta = datetime.timedelta(seconds=timeout) if timeout is not None else None
    g = Grid(grid[-2], grid[-1], dp=grid[0] if len(grid) == 3 else 1, device_type=device.type, timeout=delta)
    example_kwargs = {**cache_off_kwargs(model), **(example_kwargs or {})}  # capture refuses use_cache=True
    comp, layouts = compile_program(model, example_inputs, example_kwargs, g, options)
    agree_on_plan(comp, layouts)
    return ParallelModule(model, g, comp, layouts, options)
