"""`plan`: the compiler's plan for a grid, computed on one process without the hardware.

The same capture and passes as `parallelize` run on a model built on the meta device (or a real one:
export traces with fake tensors either way), with a planning grid that has no process groups. Costs
per rank and per training step (forward + backward):

- bytes received, per inserted module, with the conventions of `passes.mesh.CommLog` (equal to what a
  real run counts);
- FLOPs of the matmul-like ops (SUMMA products, local matmuls, attention): 2·m·k·n per product
  that runs, the forward one and a backward one per operand that needs a gradient;
- memory: parameters, gradients (same size), AdamW states (two per parameter), and -- when no
  process group is initialized in this process -- the bytes autograd saves for backward and the
  largest tensor saved or returned (temporaries inside kernels are not tracked), measured by running
  rank (0, 0)'s graph under FakeTensorMode on a fake process group of the grid's size (nothing is
  allocated). With recompute=..., that measurement runs the program with its `Recompute` regions,
  so it counts what they keep (their inputs), and `recompute_bytes` is the forward bytes the
  recomputed kernels receive again in backward (the `explain` rows of the recomputed nodes).

`compare_1d` gives the same step's bytes and parameter memory for Megatron-style 1D tensor
parallelism at p = q·q, from its analytic volume (docs/design.md section 1).
"""

from __future__ import annotations

import math
import re
import warnings
from dataclasses import asdict, dataclass, field, replace
from typing import NamedTuple

import torch
import torch.distributed as dist

from autopar.program.build import cache_off_kwargs, check_example_inputs, compile_program, resolve_cost_model
from passes.meta import LAYOUT
from passes.options import DEFAULTS, Options, format_bytes
from autopar.planning.explain import graph_rows
from autopar.planning.grids import GridChoice, search_grids
from autopar.program.spec import parse_spec
from autopar.planning.pipeline_plan import plan_pipeline
from passes.cost.cluster import resolve_cluster
from autopar.planning.progress import steps
from autopar.planning.replicas import ReplicaPlan, plan_replicas
from autopar.generate.cache import kv_cache_bytes_per_rank
from autopar.program.uneven import most_received
from passes.compat import fake_tensor_mode, fake_world, pytree
from passes.cost.cube import megatron_bytes
from passes.layout import REPLICATED, local_shape
from passes.mesh import Cube, Grid
from passes.ops.cube import CubeLinear
from autopar.errors import PlanWarning, UsageError


class ParamPlacement(NamedTuple):
    """How one parameter is stored on the grid."""
    shape: tuple  # global shape
    layout: str  # repr of its Layout, e.g. "S(0)S(1)"
    bytes_per_rank: int  # of the block each rank holds
    bytes_total: int  # of the whole tensor
    trained: bool = True  # requires_grad: a frozen one (peft's base layers) holds no gradient or optimizer state


@dataclass
class Plan:
    grid: tuple
    rows: list
    fallbacks: list  # [passes.transforms.propagate.Fallback]
    params: dict  # name -> ParamPlacement
    comm_bytes_fwd: int = 0
    comm_bytes_bwd: int = 0
    flops_per_rank: int = 0
    activation_bytes: int | None = None
    largest_tensor_bytes: int | None = None
    gm: object = field(default=None, repr=False)
    strategy: str = "2d"
    choice: object = field(default=None, repr=False)  # strategy='auto': passes.search.strategy.Choice
    kv_cache_bytes_per_rank: int | None = None  # plan(..., generation=(B, L)): the split KV cache a rank holds
    recompute: str | bool | None = None  # the recompute option planned
    recompute_bytes: int = 0  # bytes received again per rank and step by the forwards backward recomputes
    collectives_fwd: int = 0  # collective calls per rank, forward
    collectives_bwd: int = 0  # and backward
    collectives_recompute: int = 0  # forward calls backward makes again (recompute=...)
    # where the grid leaves torch.chunk blocks of unequal sizes ranks receive different bytes: the
    # figures above are grid position (0, 0)'s; these the rank that receives the most
    comm_bytes_most: int = 0
    comm_bytes_most_at: tuple = (0, 0)
    # grid=(dp, R, C): what the replica axis moves and what a rank holds (autopar.planning.replicas)
    replicas: ReplicaPlan | None = None
    # grid=p (a device count): the search's GridChoice (every candidate's row; `.layout` '3d' for the cube)
    arrangement: object = field(default=None, repr=False)

    def __repr__(self) -> str:
        """A summary (the dataclass's own repr listed every row and parameter: 54,700 characters for a
        small Llama); `autopar.explain(plan)` prints the table, `to_json()` holds everything."""
        costly = sum(1 for f in self.fallbacks if f.costly)
        cube = self.strategy == "3d" or getattr(self.arrangement, "layout", None) == "3d"
        where = f"cube {self.grid[0]}x{self.grid[0]}x{self.grid[0]} (grid {self.grid[0]}x{self.grid[1]})" if cube \
            else f"grid {self.grid[0]}x{self.grid[1]}"
        return (f"Plan({where}, strategy {self.strategy!r}: "
                f"{format_bytes(self.comm_bytes_per_rank_per_step)} received per rank per step in "
                f"{self.collectives_per_rank_per_step} collective calls, parameters "
                f"{format_bytes(self.param_bytes_per_rank)} of {format_bytes(self.param_bytes_total)} per rank, "
                f"{costly} costly fallback(s); autopar.explain(plan) prints the table)")

    @property
    def collectives_per_rank_per_step(self) -> int:
        """Collective calls each rank launches in one training step (each costs a latency alpha)."""
        return self.collectives_fwd + self.collectives_bwd + self.collectives_recompute

    @property
    def comm_bytes_per_rank_per_step(self) -> int:
        return self.comm_bytes_fwd + self.comm_bytes_bwd

    @property
    def param_bytes_per_rank(self) -> int:
        return sum(v.bytes_per_rank for v in self.params.values())

    @property
    def trained_bytes_per_rank(self) -> int:
        """Of param_bytes_per_rank, the parameters that get a gradient (requires_grad): what gradients
        and optimizer states take."""
        return sum(v.bytes_per_rank for v in self.params.values() if v.trained)

    @property
    def param_bytes_total(self) -> int:
        return sum(v.bytes_total for v in self.params.values())

    @property
    def params_above_1_over_p(self) -> dict:
        """Parameters a rank holds more than 1/p of (replicated, or split one way only): name -> bytes."""
        p = self.grid[0] * self.grid[1]
        return {n: v.bytes_per_rank for n, v in self.params.items() if v.bytes_per_rank * p > v.bytes_total}

    def to_json(self) -> dict:
        return {
            "grid": list(self.grid),
            "comm_bytes_per_rank_per_step": self.comm_bytes_per_rank_per_step,
            "comm_bytes_forward": self.comm_bytes_fwd,
            "comm_bytes_backward": self.comm_bytes_bwd,
            "flops_per_rank_per_step": self.flops_per_rank,
            "collectives_per_rank_per_step": self.collectives_per_rank_per_step,
            "collectives_forward": self.collectives_fwd,
            "collectives_backward": self.collectives_bwd,
            "collectives_recompute": self.collectives_recompute,
            "param_bytes_per_rank": self.param_bytes_per_rank,
            "param_bytes_total": self.param_bytes_total,
            "grad_bytes_per_rank": self.trained_bytes_per_rank,
            "adamw_state_bytes_per_rank": 2 * self.trained_bytes_per_rank,
            "activation_bytes_per_rank": self.activation_bytes,
            "recompute": self.recompute,
            "recompute_bytes_per_rank": self.recompute_bytes,
            "largest_tensor_bytes": self.largest_tensor_bytes,
            "params_above_1_over_p": self.params_above_1_over_p,
            "fallback_nodes": [{"node": f.node.name, "op": str(f.node.target), "module": f.path,
                                "reason": f.reason, "costly": f.costly} for f in self.fallbacks],
            "nodes": [asdict(r) for r in self.rows],
            "kv_cache_bytes_per_rank": self.kv_cache_bytes_per_rank,
            "comm_bytes_per_rank_per_step_most": self.comm_bytes_most,
            "comm_bytes_most_at": list(self.comm_bytes_most_at),
            "replicas": self.replicas.to_json() if self.replicas is not None else None,
        }


_UNMEASURED = ("autopar.plan: activation memory not measured: running rank (0, 0)'s graph on fake CPU tensors "
               "failed ({}). That happens when a model built on the meta device was captured with the code its "
               "non-CPU branches take (transformers' MoE experts count tokens with an integer histc, which has "
               "no CPU kernel); build it on the CPU to measure activations.")


def _measure_activations(gm, cap, mesh):
    """Run rank (0, 0)'s graph under FakeTensorMode on a fake process group: bytes saved for backward
    and the largest tensor. Needs no process group in this process (it makes a fake one)."""
    with fake_world(0, mesh[0] * mesh[1]):
        grid = Grid(*mesh)
        if any(isinstance(mod, CubeLinear) for mod in gm.modules()):  # strategy='3d': the cube's groups too
            Cube(mesh[0], grid=grid)
        for mod in gm.modules():  # point the planning modules at the fake groups
            if hasattr(mod, "grid"):
                mod.grid = grid
        saved, largest = {}, [0]

        def pack(t):
            # keyed by the object, kept alive here: an id alone is reused once its tensor is freed, and the
            # count then depended on when Python freed what (a 128 B drift between runs of one plan)
            saved[id(t)] = (t, t.numel() * t.element_size())
            largest[0] = max(largest[0], saved[id(t)][1])
            return t

        with fake_tensor_mode():
            args = []
            for node, (role, _) in zip(gm.graph.find_nodes(op="placeholder"), cap.sources):
                v, lay = node.meta["val"], node.meta[LAYOUT]
                if not isinstance(v, torch.Tensor):  # a constant input (use_cache=False, ...)
                    args.append(v)
                    continue
                shape = local_shape(tuple(v.shape), lay, mesh, at=(0, 0))
                grad = role == "param" and v.dtype.is_floating_point
                args.append(torch.zeros(shape, dtype=v.dtype, requires_grad=grad))
            try:
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    outs = gm(*args)
            except RuntimeError as e:  # said, not hidden: the plan's other figures stand
                warnings.warn(_UNMEASURED.format(str(e).splitlines()[0]), PlanWarning, stacklevel=3)
                return None, None
            tensors = [o for o in pytree.tree_leaves(outs) if isinstance(o, torch.Tensor) and o.requires_grad]
            for o in pytree.tree_leaves(outs):
                if isinstance(o, torch.Tensor):
                    largest[0] = max(largest[0], o.numel() * o.element_size())
            if tensors:
                sum(o.float().sum() for o in tensors).backward()
        return sum(n for _, n in saved.values()), largest[0]


def plan(model, grid=(2, 2), example_inputs=(), example_kwargs=None, *, lowering: str = DEFAULTS.lowering,
         overlap: bool | str = DEFAULTS.overlap, indivisible: str = DEFAULTS.indivisible, fused: str = DEFAULTS.fused,
         measure_activations: bool | None = None, strategy: str = DEFAULTS.strategy,
         cost_model: object = DEFAULTS.cost_model, memory_limit: float | str | None = DEFAULTS.memory_limit,
         search_budget: float | None = DEFAULTS.search_budget, generation: tuple | None = None,
         recompute: str | bool | None = DEFAULTS.recompute, moe_dispatch: str = DEFAULTS.moe_dispatch,
         grad_bucket_mb: float = DEFAULTS.grad_bucket_mb, data_parallel: str = DEFAULTS.data_parallel,
         reshard_after_forward: bool = DEFAULTS.reshard_after_forward, pipeline=None, cluster=None,
         recompute_blocks: int | None = DEFAULTS.recompute_blocks):
    """The plan `parallelize` would execute on `grid`, with its costs, computed on this process alone;
    the options are validated as `parallelize` validates them (ops without a split form are planned
    replicated, as parallelize's default on_unsupported='replicate' runs them). With strategy='auto',
    `Plan.choice` holds the assignment, its estimate, each unit's alternatives and the estimates of
    fixed 2D and fixed 1D. `generation=(batch, max_cache_len)`: also the bytes of KV cache a rank holds
    to generate with that batch and cache length (`Plan.kv_cache_bytes_per_rank`, see
    `autopar.generate.kv_cache_bytes_per_rank`), in the parameters' dtype. `grid=(dp, R, C)`: the
    R x C grid's plan, and in `Plan.replicas` what its dp replicas move and hold per rank with
    `data_parallel` ('replicate': gradient all-reduces in buckets of `grad_bucket_mb`; 'shard': FSDP2,
    with `reshard_after_forward`). `pipeline=` (an `autopar.Pipeline` or a number of stages): the
    pipeline's plan instead (`autopar.planning.pipeline_plan.PipelinePlan`: per stage and pipeline
    rank, the bubble and the step estimate); `cluster` (a `passes.cost.cluster.Cluster` or a preset's
    name, e.g. 'dgx-h100') prices each axis with the link its ranks cross (nodes of 8 GPUs: an axis
    spanning more than a node crosses InfiniBand)."""
    options = Options(lowering=lowering, overlap=overlap, indivisible=indivisible, fused=fused, strategy=strategy,
                      cost_model=cost_model, memory_limit=memory_limit, search_budget=search_budget,
                      recompute=recompute, moe_dispatch=moe_dispatch, grad_bucket_mb=grad_bucket_mb,
                      data_parallel=data_parallel, reshard_after_forward=reshard_after_forward,
                      recompute_blocks=recompute_blocks)
    example_inputs = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    spec = parse_spec(grid, strategy, pipeline, data_parallel, "autopar.plan")
    picked = None
    if spec.grid is None:  # a device count: the search arranges them
        if cluster is not None:
            raise UsageError(f"autopar.plan: grid={grid} (a device count) with cluster={cluster!r}: a cluster prices "
                             f"each axis by the links its ranks cross, which needs the arrangement; pass grid=(R, C), "
                             f"or cost_model= for the search")
        picked = search_grids(model, spec.devices, example_inputs, example_kwargs, options, replicas=False,
                              who="autopar.plan")
        spec = spec.arranged(picked.grid, picked.layout)
    dp, mesh = spec.dp, spec.mesh  # a cube's (q, q*q) grid
    check_example_inputs(model, example_inputs, example_kwargs, "autopar.plan")
    if spec.pipeline is not None:
        return plan_pipeline(model, spec.grid, spec.pipeline, example_inputs, example_kwargs, options,
                             resolve_cost_model(cost_model), resolve_cluster(cluster))
    if cluster is not None:
        mesh_cm = resolve_cluster(cluster).cost_model(1, dp, *mesh)
        options = replace(options, cost_model=mesh_cm)
    kwargs = {**cache_off_kwargs(model), **(example_kwargs or {})}
    bar = steps(f"autopar plan {mesh[0]}x{mesh[1]}", 2)
    bar.set_postfix_str("capture and passes" + (" and strategy search" if strategy == "auto" else ""))
    comp, layouts = compile_program(model, example_inputs, kwargs, Grid.for_planning(*mesh, dp=dp), options,
                                    picked.choice if picked is not None else None)
    bar.update()
    bar.set_postfix_str("costs and memory")
    gm, cap = comp.gm, comp.captured
    rows = graph_rows(comp.inspected, mesh)
    params = {}
    for name, p in model.named_parameters():
        lay = layouts.get(name, REPLICATED)
        full = p.numel() * p.element_size()
        mine = math.prod(local_shape(tuple(p.shape), lay, mesh, at=(0, 0))) * p.element_size()
        params[name] = ParamPlacement(tuple(p.shape), repr(lay), mine, full, p.requires_grad)
    result = Plan(grid=mesh, rows=rows, fallbacks=comp.fallbacks, params=params, gm=gm,
                  comm_bytes_fwd=sum(r.fwd_bytes for r in rows), comm_bytes_bwd=sum(r.bwd_bytes for r in rows),
                  flops_per_rank=sum(r.flops for r in rows), strategy=strategy, choice=comp.choice, arrangement=picked,
                  recompute=recompute, recompute_bytes=sum(r.recompute_bytes for r in rows),
                  collectives_fwd=sum(r.calls_fwd for r in rows), collectives_bwd=sum(r.calls_bwd for r in rows),
                  collectives_recompute=sum(r.calls_fwd for r in rows if r.recompute_bytes))
    result.comm_bytes_most_at, result.comm_bytes_most = most_received(comp.inspected, mesh,
                                                                      result.comm_bytes_per_rank_per_step)
    if dp > 1:
        result.replicas = plan_replicas(model, comp, layouts, mesh, dp, comp.data_parallel, grad_bucket_mb,
                                        options.reshard_after_forward)
    if generation is not None:
        dtype = next(model.parameters()).dtype
        result.kv_cache_bytes_per_rank = kv_cache_bytes_per_rank(model.config, *generation, mesh, dtype)
    if measure_activations is None:
        measure_activations = not dist.is_initialized()
    if measure_activations:
        result.activation_bytes, result.largest_tensor_bytes = _measure_activations(gm, cap, mesh)
    bar.update()
    bar.close()
    return result


def layers_and_hidden(pl: Plan) -> tuple:
    """(layers, hidden size) of the captured model, for `compare_1d` on a model without a config:
    hidden is the size most common among the dims of its 2-D parameters (the smaller of a tie);
    layers, the count of its repeated blocks (the most indices under one `prefix.<i>.` of the
    parameter names), or, without repeated blocks, its 2-D parameters over 4 (a transformer layer's
    two column/row pairs)."""
    dims: dict = {}
    blocks: dict = {}
    weights = 0
    for name, v in pl.params.items():
        if len(v.shape) == 2:
            weights += 1
            for d in v.shape:
                dims[d] = dims.get(d, 0) + 1
        m = re.match(r"^(.*?)\.(\d+)\.", name)
        if m:
            blocks.setdefault(m.group(1), set()).add(m.group(2))
    hidden = max(dims, key=lambda d: (dims[d], -d)) if dims else 0  # a tie: the narrower (h before 4h)
    layers = max((len(v) for v in blocks.values()), default=0) or weights / 4
    return layers, hidden


def compare_1d(pl: Plan, model, tokens: int, layers: int, hidden: int, dtype_bytes: int = 4) -> dict:
    """Megatron-style 1D tensor parallelism at p = q·q for the same step: per transformer layer two
    all-reduces of the [tokens, hidden] activations forward and two backward (8·(p-1)/p·B·h elements
    received per rank with ring all-reduce), plus one forward all-reduce for a vocab-parallel
    embedding; matmul weights and embeddings split p ways, norms and biases replicated."""
    p = pl.grid[0] * pl.grid[1]
    comm = sum(megatron_bytes(tokens, hidden, layers, p, dtype_bytes))  # (forward, backward)
    params = 0
    for v in pl.params.values():
        params += v.bytes_total // p if len(v.shape) >= 2 and v.shape[0] % p == 0 else v.bytes_total
    return {"p": p, "comm_bytes_per_rank_per_step": comm, "param_bytes_per_rank": params,
            "ratio_2d_over_1d_comm": pl.comm_bytes_per_rank_per_step / comm if comm else None,
            "ratio_2d_over_1d_params": pl.param_bytes_per_rank / params if params else None}


def choose_grid(model, devices: int, example_inputs=(), example_kwargs=None, *,
                cost_model: object = DEFAULTS.cost_model,
                memory_limit: float | str | None = DEFAULTS.memory_limit, indivisible: str = DEFAULTS.indivisible,
                fused: str = DEFAULTS.fused, search_budget: float | None = DEFAULTS.search_budget,
                replica_layouts: bool = True) -> GridChoice:
    """How to arrange `devices` ranks: every R x C grid, the q x q x q cube where devices = q^3 (3D
    tensor parallelism per unit), and with `replica_layouts` d data-parallel replicas of
    an R x C grid, each on 1/d of the example batch; each candidate's units split the way its search
    estimates fastest within `memory_limit` (`autopar.planning.grids`). Returns a GridChoice, which
    unpacks as (grid, table): the arrangement picked and a row per candidate (its fixed schemes'
    estimates, the search's where it ran); `.kwargs` is what to pass `parallelize` for it. The model
    is captured once (once more per replica count); `search_budget` bounds each of the per-unit searches
    (`autopar.planning.grids.SEARCHED` at most)."""
    options = Options(strategy="auto", cost_model=cost_model, memory_limit=memory_limit, indivisible=indivisible,
                      fused=fused, search_budget=search_budget)
    return search_grids(model, devices, example_inputs, example_kwargs, options, replicas=replica_layouts)
