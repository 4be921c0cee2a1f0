"""`parallelize`: check the grid and options, agree on them between ranks, compile the program of
the example inputs and wrap it in a `ParallelModule` (`autopar.parallel.module`)."""

from __future__ import annotations

import datetime

import torch
import torch.nn as nn

from autopar.errors import CompileWarning, FallbackWarning, NoProcessGroupError, PlanWarning, UsageError
from autopar.parallel.arrange import arrange
from autopar.parallel.module import ParallelModule
from autopar.parallel.pipeline import pipeline_parallelize
from autopar.parallel.sharded import shard_replicas
from autopar.program import context
from autopar.program.build import cache_off_kwargs, check_example_inputs, compile_program
from autopar.program.device import check_device, model_device
from autopar.program.spec import parse_spec
from autopar.program.guards import agree_on_options, agree_on_plan
from passes import Grid
from passes.mesh import Cube
from passes.compat import group_timeout
from passes.mesh import warn
from passes.options import DEFAULTS, Options

# ParallelModule, FallbackWarning and CompileWarning: what `autopar.api`, this module's old path, exported
__all__ = ["parallelize", "ParallelModule", "FallbackWarning", "CompileWarning"]


def _cube_grid(grid: tuple, device_type: str, timeout) -> Grid:
    """strategy='3d': the (q, q*q) grid of a q x q x q cube, with the cube's groups attached (`Grid.cube`)."""
    q = grid[0]
    g = Grid(q, q * q, device_type=device_type, timeout=timeout)
    Cube(q, device_type, g)
    return g


def _context_grid(model, spec, options: Options, device_type: str, timeout) -> Grid:
    """context_parallel=cp: cp copies of the (R, C) grid over the replica axis, each on 1/cp of the sequence; with
    grid=(dp, R, C), dp such groups of cp copies side by side, each on a batch of its own (dp * cp replicas)."""
    cp, world = options.context_parallel, torch.distributed.get_world_size()
    if spec.cube or options.data_parallel == "auto":
        raise UsageError(
            f"autopar.parallelize: context_parallel={cp} composes with an (R, C) or (dp, R, C) grid of 1D, 2D or "
            f"'auto' tensor parallelism (its cp ranks replicate or, with data_parallel='shard', shard the grid's "
            f"blocks), not yet with pipeline stages, data_parallel='auto' or strategy='3d'")
    rows, cols = spec.mesh
    if spec.dp * rows * cols * cp != world:
        need = f"{spec.dp} * " if spec.dp > 1 else ""
        raise UsageError(f"autopar.parallelize: context_parallel={cp} on grid={spec.grid} needs "
                         f"{need}{cp} * {rows} * {cols} = {spec.dp * cp * rows * cols} processes, and the world size "
                         f"is {world}: pick a grid of {world // cp if world % cp == 0 else 'world / cp'} ranks")
    context.check_model(model, cp, "autopar.parallelize")
    g = Grid(rows, cols, dp=spec.dp * cp, device_type=device_type, timeout=timeout)
    g.cp = cp
    if spec.dp > 1:  # each batch's cp ranks: a group of their own (every rank creates every group, in order)
        key = (g.shape, g.dp, cp, device_type, timeout)
        if key not in _CP_GROUPS or _CP_GROUPS[key][0] is not torch.distributed.group.WORLD:
            mine = None
            for b in range(spec.dp):
                for pos in range(rows * cols):
                    ranks = [(b * cp + i) * rows * cols + pos for i in range(cp)]
                    group = torch.distributed.new_group(ranks, timeout=timeout)
                    mine = group if g.rank in ranks else mine
            _CP_GROUPS[key] = (torch.distributed.group.WORLD, mine)
        g.cp_group = _CP_GROUPS[key][1]
    return g


_CP_GROUPS: dict = {}  # (shape, replicas, cp, device type, timeout) -> (the default group, this rank's cp group)


def _name_2d_linears(pmodel: ParallelModule, q: int) -> None:
    """strategy='3d': a PlanWarning naming the linears that run 2D SUMMA on the cube's (q, q*q) grid
    instead (a tied LM head whose table the embedding placed first, sizes the cube does not divide)."""
    from autopar.planning.explain import rows

    two_d = [f"{r.module or r.node} ({r.note})" for r in rows(pmodel) if r.op.startswith("SummaLinear")]
    if two_d:
        warn(f"strategy='3d': {len(two_d)} linear(s) run 2D SUMMA on the {q}x{q * q} grid, not 3D: "
             + "; ".join(two_d), PlanWarning, stacklevel=3)


def parallelize(model: nn.Module, grid=(2, 2), example_inputs=(), example_kwargs=None, *,
                lowering: str = DEFAULTS.lowering, overlap: bool | str = DEFAULTS.overlap,
                indivisible: str = DEFAULTS.indivisible, fused: str = DEFAULTS.fused,
                on_unsupported: str = DEFAULTS.on_unsupported,
                strategy: str = DEFAULTS.strategy, cost_model: object = DEFAULTS.cost_model,
                memory_limit: float | str | None = DEFAULTS.memory_limit,
                search_budget: float | None = DEFAULTS.search_budget, check_inputs: bool = DEFAULTS.check_inputs,
                checks: str = DEFAULTS.checks, timeout: float | None = DEFAULTS.timeout,
                compile: bool = DEFAULTS.compile,
                recompute: str | bool | None = DEFAULTS.recompute,
                recompute_blocks: int | None = DEFAULTS.recompute_blocks,
                grad_bucket_mb: float = DEFAULTS.grad_bucket_mb, moe_dispatch: str = DEFAULTS.moe_dispatch,
                data_parallel: str = DEFAULTS.data_parallel,
                reshard_after_forward: bool = DEFAULTS.reshard_after_forward,
                fsdp_prefetch: int | None = DEFAULTS.fsdp_prefetch,
                context_parallel: int = DEFAULTS.context_parallel,
                context_attention: str = DEFAULTS.context_attention, pipeline=None):
    """Compile `model` for tensor parallelism on an R x C grid; call on every rank.

    Args:
        model: an unmodified nn.Module (it is not changed; its weights are copied into shards).
        grid: (R, C), e.g. (2, 2) or (2, 4); R*C must equal the world size of the default process
            group. Activations split batch over the R rows and hidden over the C columns. (dp, R, C)
            runs dp data-parallel replicas of the grid. A device count p (the world size) with
            strategy='auto': rank 0's search arranges the ranks as the R x C grid or, where p = q**3,
            the q x q x q cube (each matmul unit 3d, 2d, 1d or replicated) estimated fastest within
            `memory_limit` (`autopar.choose_grid` shows the table); `pmodel.grid` is the one it built.
        strategy: how each weight matmul is split. '2d' (default): SUMMA on the grid. '1d':
            Megatron-style column/row splits over the C columns (batch over the R rows; on a (1, p)
            grid this is plain 1D tensor parallelism). 'auto': per matmul group (q|k|v, gate|up, one
            projection, an embedding) the option among 2d / 1d / replicated with the smallest
            estimated step time whose per-rank memory fits `memory_limit` (see passes/search/strategy.py and
            `explain`, which shows each choice against its alternatives).
        cost_model: for strategy='auto' (and lowering='auto', overlap='auto'): the JSON path (or dict)
            `autopar calibrate` wrote, or None for published GPU-cluster figures (NVLink inside a node,
            InfiniBand across nodes).
        memory_limit: for strategy='auto': the memory per rank (parameters, gradients, Adam states and
            activations, estimated), in bytes (40 * 2**30) or as a string with a unit ('40GiB',
            '500MB'); None: no limit.
        search_budget: for strategy='auto': seconds the search may take (default 30) before it stops
            with the best plan found so far and a SearchWarning; None: no limit. Rank 0 searches and
            sends its choice to the other ranks.
        example_inputs / example_kwargs: one call's inputs, used to capture the graph.
        lowering: 'auto' (default: each SUMMA product the lowering `cost_model` prices faster),
            'broadcast' (the paper's stepwise SUMMA, one block in flight) or 'allgather' (gather panels,
            one matmul, one call per axis; linears that read the same activation, q|k|v and gate|up,
            then share one set of calls and x's panel: `passes.transforms.group_siblings`), or 'ring'
            (the broadcast lowering's pieces sent point to point in Cannon's rotated order, each rank
            starting at piece (r + c) mod S: the same bytes, no collective, `passes.ops.ring`; 'auto'
            never picks it).
        overlap: whether communication runs behind the matmuls. True: each SUMMA product posts its next
            panel's transfer before the current panel's matmul (broadcast and ring lowerings; one panel
            in flight; the all-gather lowering posts both panels' gathers together) and each weight
            gradient's reduction runs behind the input gradient's product;
            False: every transfer is waited for before the compute that follows (the in-line baseline;
            the same calls, bytes and results). 'auto' (default): on where `cost_model` says a matmul
            hides a transfer (its `hidden` share, 1 for the published figures, measured by `autopar
            calibrate`). The estimate prices the choice (`passes.search.estimate`).
        indivisible: a dim the grid does not divide (a vocabulary of 50257, 25 heads on 8 columns).
            'uneven' (default) splits it in torch.chunk blocks, as DTensor's Shard does (ceil(n/q)
            per member, the last shorter; nothing padded, state_dict and checkpoints keep the true
            shapes) where the rule can: vocabularies (embedding, LM head, cross-entropy), matmul
            out-features, attention heads, elementwise ops and views that keep the dim; a matmul whose
            in-features the grid does not divide still runs unsplit. 'replicate' runs every such matmul
            unsplit on every rank, with a FallbackWarning; 'error' raises a ShardingError instead.
        fused: how a fused projection's weight (output split into q|k|v or gate|up) is stored.
            'regroup' (default): as ordinary blocks, regrouped in the graph each step so each column
            block holds matching parts (one all-to-all of the chunks other columns hold per use,
            forward and backward); every parameter stays a plain sharded DTensor. 'interleave': stored interleaved
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
        check_inputs: verify on every call that all ranks of a grid passed the same inputs (shapes,
            dtypes and a checksum of the values; one all-reduce of four int64 per call). On by default:
            every rank of a grid computes on the same batch, so a rank that draws its own (as under
            DDP) raises instead of training on a mix. False compares only the shapes and dtypes.
        checks: when the verdicts of the run-time checks (the inputs agree; ids and cross-entropy targets lie
            in their tables; a pipeline's micro-batches each count a target) are read on the host. 'now': at
            once, by the call that failed (a device-to-host sync per check); 'late': copied to the host
            without waiting and read by the next call, which raises the error (no sync in the step);
            'auto' (default): 'now' on the CPU, where reading waits for nothing, 'late' on accelerators.
            After the last step, `autopar.flush_checks()` reads what is pending.
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
        recompute_blocks: with recompute='blocks', recompute only the first k repeated blocks (of each
            pipeline stage: Megatron's --recompute-num-layers); the others keep their activations.
        grad_bucket_mb: with grid=(dp, R, C), dp > 1: the parameter gradients are averaged over the
            replicas in buckets of at most this many MiB, one all-reduce each (default 25; 0: one per
            parameter block). Eagerly, each bucket's all-reduce starts during backward as soon as its
            gradients are complete and is waited for at the end of backward; see
            `passes.ops.grad_buckets` and `pmodel.grad_bucket_plan()`.
        moe_dispatch: how a mixture of experts' routed tokens reach their experts (split over the
            grid rows). 'all_to_all': each row keeps its tokens and sends each routed token's hidden
            block to its expert's row and back (expert parallelism); 'gather': every row gathers
            all the routed tokens; 'auto' (default): all-to-all when the grid has more than one row.
        data_parallel: with grid=(dp, R, C): 'replicate' (default) keeps each grid block's parameters,
            gradients and optimizer state whole on every replica (gradients all-reduced in buckets);
            'shard' splits them over the dp replicas with FSDP2's `fully_shard` (ZeRO-3): each rank
            holds 1/(dp*R*C) of every parameter, gradient and optimizer state between steps, the
            repeated block (`model.layers.3`) is one FSDP2 unit, whose parameters are all-gathered over
            the replicas just before it runs and whose gradients are reduce-scattered as soon as its
            backward is done; the rest of the model is one more unit, gathered for the whole step (see
            `autopar.parallel.sharded`); 'auto': 'shard' only where the memory estimate with
            'replicate' exceeds `memory_limit` and the one with 'shard' does not (without a
            memory_limit, 'replicate').
        reshard_after_forward: with data_parallel='shard': True (FSDP2's default) releases each
            block's gathered parameters after its forward and gathers them again for its backward;
            False keeps them from its forward to its backward (one all-gather a step, more memory).
        pipeline: None, or `autopar.Pipeline(stages=S, schedule='1f1b', microbatches=M, split_points=...)`
            (an int S: Pipeline(stages=S)): cut the model into S pipeline stages, each parallelized on
            an R x C grid of its own (world size S*R*C, stage s on ranks s*R*C ... (s+1)*R*C - 1),
            run by torch.distributed.pipelining's schedule; returns a `PipelineModule`, trained with
            `pmodel.train_step(...)` (see `autopar.parallel.pipeline`).
        fsdp_prefetch: with data_parallel='shard': None (FSDP2's implicit prefetching: in backward
            the next block's gather starts before the current block's backward) or k >= 1 (each block
            starts the gathers of the next k blocks before it runs, in forward and in backward).
        context_parallel: cp > 1 splits each sequence over cp copies of the grid (zig-zag chunks; every rank
            passes the same whole batch; world = cp * R * C); see docs/guide/context-parallel.md.
        context_attention: with context_parallel, how each attention sees the other ranks' tokens:
            'alltoall' (heads exchanged), 'ring' (K/V blocks passed around the cp ranks beside the block
            products), 'allgather' (K and V gathered whole), 'auto' (all-to-all where this rank's query
            and KV heads divide by cp, else the ring).
    """
    options = Options(lowering=lowering, overlap=overlap, indivisible=indivisible, fused=fused,
                      on_unsupported=on_unsupported,
                      strategy=strategy, cost_model=cost_model, memory_limit=memory_limit,
                      search_budget=search_budget, check_inputs=check_inputs, checks=checks, timeout=timeout,
                      compile=compile, recompute=recompute, grad_bucket_mb=grad_bucket_mb,
                      moe_dispatch=moe_dispatch, data_parallel=data_parallel, recompute_blocks=recompute_blocks,
                      reshard_after_forward=reshard_after_forward, fsdp_prefetch=fsdp_prefetch,
                      context_parallel=context_parallel, context_attention=context_attention)
    spec = parse_spec(grid, strategy, pipeline, data_parallel, "autopar.parallelize")
    nested = next((n for n, m in model.named_modules() if isinstance(m, ParallelModule)), None) \
        if isinstance(model, nn.Module) else None
    if nested is not None:
        raise UsageError(
            f"{'this model is' if nested == '' else f'submodule {nested!r} of this model is'} already parallelized "
            f"(a ParallelModule): parallelize the original model once, e.g. "
            f"autopar.parallelize(pmodel.source_model, ...) for another grid or options")
    if not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,)
    check_example_inputs(model, example_inputs, example_kwargs, "autopar.parallelize")
    if not torch.distributed.is_initialized():
        raise NoProcessGroupError(
            "autopar.parallelize needs torch.distributed: call torch.distributed.init_process_group "
            "(backend 'gloo' on CPU, 'nccl' on GPUs) on every rank first, or use autopar.launch.spawn"
        )
    device = model_device(model, example_inputs, example_kwargs)  # the parameters' (a meta model: the inputs')
    check_device(device)  # before the first object collective: NCCL stages it on the current device
    # parallelize's own two handshakes wait up to the process group's timeout, not `timeout`: ranks
    # capture and plan at different speeds (seconds apart on a loaded machine, more with strategy='auto')
    agree_on_options(spec.handshake, options, device.type)
    # timeout=None: the process group's own (the grid's groups would otherwise get torch's default, 30 min)
    delta = datetime.timedelta(seconds=timeout) if timeout is not None else \
        group_timeout(torch.distributed.group.WORLD, device.type)
    arranged, table = None, None
    if context_parallel > 1 and (spec.grid is None or spec.pipeline is not None):
        raise UsageError(f"autopar.parallelize: context_parallel={context_parallel} takes an explicit grid, (R, C) or "
                         f"(dp, R, C), and no pipeline stages yet; got grid={grid!r}, pipeline={pipeline!r}")
    if spec.grid is None:  # a device count: rank 0's search arranges them
        spec.check_world(torch.distributed.get_world_size(), "autopar.parallelize")
        found, layout, arranged, table = arrange(model, spec.devices, example_inputs, example_kwargs, options)
        spec = spec.arranged(found, layout)
    if spec.pipeline is not None:
        return pipeline_parallelize(model, spec, example_inputs, example_kwargs, options, device, delta)
    example_kwargs = {**cache_off_kwargs(model), **(example_kwargs or {})}  # capture refuses use_cache=True
    if context_parallel > 1:
        g = _context_grid(model, spec, options, device.type, delta)
        example_inputs, example_kwargs = context.local_call(g, example_inputs, example_kwargs, "autopar.parallelize")
    else:
        g = _cube_grid(spec.grid, device.type, delta) if spec.cube else \
            Grid(*spec.mesh, dp=spec.dp, device_type=device.type, timeout=delta)
    comp, layouts = compile_program(model, example_inputs, example_kwargs, g, options, arranged)
    agree_on_plan(comp, layouts, model)
    pmodel = ParallelModule(model, g, comp, layouts, options)
    pmodel.arrangement = table  # grid=p: the search's row per candidate arrangement, for explain
    if strategy == "3d":
        _name_2d_linears(pmodel, spec.grid[0])
    if comp.data_parallel == "shard":  # asked for, or data_parallel='auto' where only it fits memory_limit
        shard_replicas(pmodel)
    elif reshard_after_forward is not True or fsdp_prefetch is not None:
        warn(f"reshard_after_forward={reshard_after_forward!r} / fsdp_prefetch={fsdp_prefetch!r} have no effect: the "
             f"replicas are not sharded (data_parallel={comp.data_parallel!r} on grid {spec.grid}); they apply to "
             f"data_parallel='shard' on grid=(dp, R, C) with dp > 1", PlanWarning, stacklevel=2)
    return pmodel
