"""`plan(..., pipeline=...)`: what a pipelined model's stages cost, computed on one process.

The model is cut as `parallelize(..., pipeline=...)` cuts it (`autopar.program.pipe.cut`), and each
stage is compiled on a planning grid in order, its received values placed as the stage before sends
them, exactly as the ranks compile them. Per stage and micro-batch: the grid's bytes and calls, the
FLOPs, the parameters a rank holds, the blocks it sends to the next stage (and the gradients it sends
back), and the estimate (`passes.search.lowering.fixed_estimate`: compute and the grid's collectives,
one micro-batch's forward and backward, with its activations). A weight tied across stages (an LM head
on the token embedding) is compiled in its first stage's layout in every stage, as the ranks do (the
estimate prices each copy in its own stage's preferred layout).

Then per pipeline rank (its stages: p, p+S, ...; or p and 2S-1-p): its work, one micro-batch through
each of its stages plus its point-to-point sends (priced with the pipeline axis's link), and the
replica axis's gradient traffic. The step estimate is the slowest rank's work over the M micro-batches
stretched by the schedule's bubble (`passes.cost.pipeline.bubble`):

    step = (M * max_p work_p) / (1 - bubble) + replicas_p

Memory per rank: its stages' parameters, gradients and optimizer states, and the activations of the
micro-batches in flight (`passes.cost.pipeline.in_flight`: GPipe all M, 1F1B about S - p).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch

from autopar.errors import MemoryLimitError, UsageError
from autopar.planning.explain import graph_rows
from autopar.program.build import capture, compile_captured, signature
from autopar.program.pipe import (Pipeline, chunks, crossings, cut, named, rank_of, schedule_refusal, split_points,
                                  stage_ids, tied_names)
from passes.compat import pytree
from passes.cost.cluster import Cluster
from passes.cost.model import CostModel
from passes.cost.pipeline import bubble, in_flight
from passes.cost.volumes import all_gather_bytes, all_reduce_bytes, reduce_scatter_bytes
from passes.layout import REPLICATED, local_shape
from passes.mesh import Grid
from passes.nodes import block_path
from passes.meta import PLACED
from passes.options import format_bytes
from passes.search.lowering import fixed_estimate

__all__ = ["PipelinePlan", "StagePlan", "choose_pipeline", "combine", "plan_pipeline", "stage_plans"]


@dataclass
class StagePlan:
    """One stage, per rank of its grid (position (0, 0)) and per micro-batch."""

    index: int
    rank: int  # the pipeline rank holding it
    layers: list  # the repeated blocks it runs
    param_bytes: int  # its parameter blocks on one rank
    trained_bytes: int  # of which get a gradient
    comm_bytes: int  # the grid's collectives, forward and backward
    calls: int
    flops: int
    send_fwd_bytes: int  # its blocks of the values it sends to the next stage
    send_bwd_bytes: int  # the gradients it sends back to the stage before
    sends: int  # point-to-point sends, both ways
    time_s: float  # estimated forward and backward of one micro-batch on its grid
    activation_bytes: float  # saved for its backward, one micro-batch
    state_bytes: float  # parameters, gradients and AdamW states a rank holds (the estimate's; 1/d sharded)


@dataclass
class PipelinePlan:
    """The plan of `pipeline` on `grid` ((d, R, C)): per stage (`stages`) and per pipeline rank
    (`ranks`: stages, work per micro-batch, sends and replica traffic per step, memory), the bubble
    and the step estimate. Estimates, not measurements."""

    grid: tuple
    pipeline: Pipeline
    stages: list
    ranks: list = field(default_factory=list)
    bubble: float = 0.0
    step_s: float = 0.0
    cost_source: str = ""
    tokens_per_step: int = 0

    @property
    def memory_bytes(self) -> float:
        """The most any rank holds (parameters, gradients, optimizer states, activations in flight)."""
        return max(r["memory_bytes"] for r in self.ranks)

    @property
    def tokens_per_s_per_gpu(self) -> float:
        world = self.pipeline.stages * math.prod(self.grid)
        return self.tokens_per_step / self.step_s / world if self.step_s else 0.0

    def to_json(self) -> dict:
        return {"grid": list(self.grid), "stages": self.pipeline.stages, "schedule": self.pipeline.schedule,
                "microbatches": self.pipeline.n_microbatches, "stages_per_rank": self.pipeline.stages_per_rank,
                "bubble": self.bubble, "step_s": self.step_s, "memory_bytes": self.memory_bytes,
                "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu, "cost_source": self.cost_source,
                "per_stage": [vars(s) for s in self.stages], "per_rank": self.ranks}

    def __str__(self) -> str:
        p = self.pipeline
        lines = [f"pipeline {p.stages} x grid {'x'.join(map(str, self.grid))}, schedule {p.schedule!r}, "
                 f"{p.n_microbatches} micro-batches, {p.stages_per_rank} stage(s) per rank ({self.cost_source})",
                 "stage  rank  layers        params/rank  grid bytes/mb  sends/mb (fwd+bwd)  est/mb",
                 *(f"{s.index:>5}  {s.rank:>4}  {_span(s.layers):<12}  {format_bytes(s.param_bytes):>11}  "
                   f"{format_bytes(s.comm_bytes):>13}  {format_bytes(s.send_fwd_bytes + s.send_bwd_bytes):>18}  "
                   f"{s.time_s * 1e3:8.2f} ms" for s in self.stages),
                 f"estimated bubble {self.bubble:.1%} of the step; step {self.step_s:.3f} s"
                 + (f", {self.tokens_per_s_per_gpu:,.0f} tokens/s per GPU" if self.tokens_per_step else ""),
                 *(f"pipeline rank {r['rank']}: stages {r['stages']}, work {r['work_s'] * 1e3:.2f} ms per "
                   f"micro-batch, {r['in_flight']} micro-batch(es) in flight, memory "
                   f"{format_bytes(r['memory_bytes'])}, replica axis {r['replica_s'] * 1e3:.1f} ms per step"
                   for r in self.ranks)]
        return "\n".join(lines)


def _span(layers: list) -> str:
    if not layers:
        return "-"
    nums = [int(x.rsplit(".", 1)[1]) for x in layers]
    return f"{min(nums)}-{max(nums)}" if len(nums) > 1 else str(nums[0])


def plan_pipeline(model, grid: tuple, pipe: Pipeline, example_inputs: tuple, example_kwargs, options,
                  cost_model: CostModel, cluster: Cluster | None = None) -> PipelinePlan:
    """See the module docstring. `grid`: (R, C) or (d, R, C); `options`: plan's; `cost_model`: the grid
    axes' figures where `cluster` is None (the pipeline and replica axes then use axis 0's, the slower)."""
    d = grid[0] if len(grid) == 3 else 1
    R, C = grid[-2:]
    kwargs = named(model, example_inputs, example_kwargs or {})
    _, first = chunks((), kwargs, pipe.n_microbatches)[0]
    cm = cluster.cost_model(pipe.stages, d, R, C) if cluster else cost_model
    stages = stage_plans(model, first, split_points(model, pipe.split_points, pipe.total), (R, C), options, cm)
    ids = kwargs.get("input_ids")
    tokens = int(ids.numel()) * d if isinstance(ids, torch.Tensor) else 0
    return combine(stages, pipe, (d, R, C), options, cm, cluster, tokens)


def stage_plans(model, first: dict, points: tuple, mesh: tuple, options, cm) -> list:
    """Every stage of the model cut at `points`, compiled on an R x C planning grid in order (what it
    receives placed as the stage before sends it) and priced with `cm`, for one micro-batch `first` (its
    inputs by name): `StagePlan`s with `rank` unset (it depends on the schedule's placement)."""
    if any(p.is_meta for p in model.parameters()):  # trace all on meta, as capture does
        first = pytree.tree_map_only(torch.Tensor, lambda t: t.to("meta"), first)
    n = len(points) + 1
    cut_model, seen, _ = cut(model, points, (), first, n)
    needs, crossing = crossings(cut_model)
    options = replace(options, replicas=1, data_parallel="replicate")
    g = Grid.for_planning(*mesh)
    layouts: dict = {}
    tied_to, tied = tied_names(model), {}  # a weight tied across stages: each copy in its first stage's layout
    stages = []
    for j in range(n):
        stage_mod = cut_model.get_stage_module(j)
        args = seen[j][0]
        cap = _placed(stage_mod, args, needs[j], layouts)
        reads = {key for node, (role, key) in zip(cap.gm.graph.find_nodes(op="placeholder"), cap.sources)
                 if role == "param" and node.users}
        mine = {name: tied_to[name] for name in reads if name in tied_to}
        comp, params = compile_captured(cap, signature(args, {}, True), g, options, None,
                                        {name: tied[first] for name, first in mine.items() if first in tied})
        tied = {**{first: params[name] for name, first in mine.items()}, **tied}
        layouts.update(((j, k), o[0] if o else REPLICATED) for k, o in enumerate(comp.out_layouts))
        rows = graph_rows(comp.inspected, mesh)
        est, _ = fixed_estimate(_placed(stage_mod, args, needs[j], layouts).gm, mesh, cm, options.strategy, options)

        def block_bytes(v):
            out = seen[v[0]][1]
            t = out[v[1]] if isinstance(out, tuple) else out
            return math.prod(local_shape(tuple(t.shape), layouts[v], mesh, at=(0, 0))) * t.element_size(), t

        outs = [block_bytes(v) for v in (crossing[j] if j < n - 1 else [])]
        ins = [block_bytes(v) for v in (crossing[j - 1] if j else [])]
        held = trained = 0
        for name, p in stage_mod.named_parameters():
            if name not in reads:  # a tied copy torch's cut left in a stage that does not read it: not held
                continue
            b = math.prod(local_shape(tuple(p.shape), params.get(name, REPLICATED), mesh, at=(0, 0))) * p.element_size()
            held += b
            trained += b if p.requires_grad else 0
        stages.append(StagePlan(
            j, -1, sorted({block_path(nm) for nm in reads} - {None}),
            held, trained, sum(r.fwd_bytes + r.bwd_bytes for r in rows), sum(r.calls_fwd + r.calls_bwd for r in rows),
            sum(r.flops for r in rows), sum(b for b, _ in outs), sum(b for b, t in ins if t.requires_grad),
            len(outs) + sum(1 for _, t in ins if t.requires_grad), est.time_s, est.activation_bytes,
            est.memory_bytes - est.activation_bytes))
    return stages


def combine(stages: list, pipe: Pipeline, grid: tuple, options, cm, cluster: Cluster | None,
            tokens: int = 0) -> PipelinePlan:
    """The plan of `pipe` on (d, R, C) from its `stage_plans`: each pipeline rank's work, sends, replica
    traffic and memory, the bubble and the step estimate. With options.data_parallel 'shard' the
    replicas split each stage's parameters, gradients and optimizer states d ways (FSDP2, gathered and
    reduce-scattered once per micro-batch)."""
    d, R, C = grid
    S, m = pipe.stages, pipe.n_microbatches
    shard = d > 1 and options.data_parallel == "shard"
    stages = [replace(st, rank=rank_of(st.index, S, pipe.style), state_bytes=st.state_bytes / (d if shard else 1))
              for st in stages]
    result = PipelinePlan((d, R, C), pipe, stages, cost_source=getattr(cm, "source", ""), tokens_per_step=tokens)
    result.bubble = bubble(pipe.schedule, S, m, pipe.stages_per_rank)
    pp = cluster.axis_link("pp", S, d, R, C) if cluster else None
    dp_link = cluster.axis_link("dp", S, d, R, C) if cluster else None
    alpha_pp, beta_pp = (pp.alpha_s, pp.beta_bytes_per_s) if pp else (cm.alpha[0], cm.beta[0])
    alpha_dp, beta_dp = (dp_link.alpha_s, dp_link.beta_bytes_per_s) if dp_link else (cm.alpha[0], cm.beta[0])
    for p in range(S):
        mine = [stages[j] for j in stage_ids(p, S, pipe.stages_per_rank, pipe.style)]
        work = sum(s.time_s + s.sends * alpha_pp + (s.send_fwd_bytes + s.send_bwd_bytes) / beta_pp for s in mine)
        trained_b = sum(s.trained_bytes for s in mine)
        replica_s = 0.0
        if shard:  # FSDP2: gathered twice, reduce-scattered once per micro-batch
            moved = m * (2 * all_gather_bytes(trained_b, d) + reduce_scatter_bytes(trained_b, d))
            replica_s = moved / beta_dp + m * 3 * len(mine) * alpha_dp
        elif d > 1:  # averaged once per step after the schedule, one bucket per grad_bucket_mb
            buckets = max(1, math.ceil(trained_b / (options.grad_bucket_mb * 2**20)))
            replica_s = all_reduce_bytes(trained_b, d) / beta_dp + buckets * alpha_dp
        flight = in_flight(pipe.schedule, S, m, pipe.stages_per_rank, p)
        memory = sum(s.state_bytes + s.activation_bytes * flight for s in mine)
        result.ranks.append({"rank": p, "stages": [s.index for s in mine], "work_s": work, "in_flight": flight,
                             "replica_s": replica_s, "memory_bytes": memory,
                             "sends_per_step_bytes": m * sum(s.send_fwd_bytes + s.send_bwd_bytes for s in mine)})
    slowest = max(r["work_s"] for r in result.ranks)
    result.step_s = m * slowest / (1 - result.bubble) + max(r["replica_s"] for r in result.ranks)
    return result


def _placed(stage_mod, args: tuple, needs: list, layouts: dict):
    """The stage captured with its received values `PLACED` as the stage before makes them."""
    cap = capture(stage_mod, args, {})
    for node, (role, key) in zip(cap.gm.graph.find_nodes(op="placeholder"), cap.sources):
        if role == "input" and needs[key] in layouts:
            node.meta[PLACED] = layouts[needs[key]]
    return cap



def choose_pipeline(model, devices: int, example_kwargs: dict, *, cluster="dgx-h100", memory_limit=None,
                    stages=None, grids=None, schedules=("1f1b", "interleaved_1f1b"), microbatch_rows: int = 1,
                    data_parallel=("replicate", "shard"), recompute=(False, "blocks"),
                    cache: dict | None = None) -> tuple:
    """(the PipelinePlan with the smallest estimated step that fits `memory_limit` (None: the cluster's
    memory per GPU), a row per layout tried) for `devices` ranks and the global batch `example_kwargs`
    (its rows split over the replicas, each replica's rows into micro-batches of `microbatch_rows`).

    Tried: every S in `stages` (default: the divisors of `devices` from 2 to 16 that the model's
    repeated blocks allow), every R x C in `grids` (default: R*C dividing devices/S and at most one node,
    so the grid's collectives stay on NVLink), d = devices/(S*R*C), each schedule (interleaved with 2
    stages per rank), each data_parallel mode where d > 1, each `recompute` (False, or 'blocks': every
    repeated block recomputed in backward); 1 x C grids run the 1D strategy, others 2D.
    The stages of one (S*V, R, C) are compiled and priced once (`stage_plans`) and combined per d, M,
    schedule and replica mode (`combine`); pass a dict as `cache` to keep them across calls (other device
    counts, same model and micro-batch). Estimates (see the module docstring), not measurements."""
    from autopar.program.pipe import blocks
    from passes.cost.cluster import resolve_cluster
    from passes.options import DEFAULTS, Options

    cl = resolve_cluster(cluster)
    limit = Options(memory_limit=memory_limit).memory_limit_bytes if memory_limit is not None else \
        (cl.memory_bytes if cl else None)
    kwargs = named(model, (), dict(example_kwargs))
    rows = next(t.shape[0] for t in kwargs.values() if isinstance(t, torch.Tensor) and t.dim() > 0)
    layers = len(blocks(model))
    stages = stages or [s for s in range(2, 17) if devices % s == 0 and s <= layers]
    if not stages:
        raise UsageError(f"choose_pipeline: no pipeline of {devices} devices to try: no stage count from 2 to 16 "
                         f"divides {devices} with at most one stage per repeated block ({layers} blocks); for one "
                         f"stage use autopar.choose_grid(model, {devices}, ...), or pass stages=[...] and a device "
                         f"count they divide")
    refused: list = []  # layouts torch's schedule would refuse: never returned
    node = cl.gpus_per_node if cl else devices
    cache = {} if cache is None else cache
    table, best = [], None
    for S in stages:
        for R, C in grids or [(r, t // r) for t in range(1, node + 1) if (devices // S) % t == 0
                              for r in range(1, t + 1) if t % r == 0]:
            d = devices // (S * R * C)
            if S * d * R * C != devices or rows % (d * microbatch_rows):
                continue
            M = rows // (d * microbatch_rows)
            for schedule in schedules:
                V = 1 if schedule in ("gpipe", "1f1b") else 2
                if S * V > layers:
                    continue
                why = schedule_refusal(schedule, S, V, M)
                if why:
                    refused.append(f"{S} stages x {R}x{C}, {schedule}, {M} micro-batches: {why}")
                    continue
                pipe = Pipeline(stages=S, schedule=schedule, microbatches=M, stages_per_rank=V)
                strategy = "1d" if R == 1 and C > 1 else "2d"
                cm = cl.cost_model(S, d, R, C) if cl else CostModel.resolve(None)
                for again in recompute:
                    options = replace(DEFAULTS, strategy=strategy, recompute=again)
                    key = (S * V, R, C, again)
                    if key not in cache:
                        _, first = chunks((), kwargs, rows // microbatch_rows)[0]
                        cache[key] = stage_plans(model, first, split_points(model, None, S * V), (R, C), options, cm)
                    for mode in (data_parallel if d > 1 else ("replicate",)):
                        pl = combine(cache[key], pipe, (d, R, C), replace(options, data_parallel=mode), cm, cl,
                                     int(kwargs["input_ids"].numel()) if "input_ids" in kwargs else 0)
                        fits = limit is None or pl.memory_bytes <= limit
                        table.append({"stages": S, "d": d, "grid": (R, C), "schedule": schedule,
                                      "stages_per_rank": V, "microbatches": M, "data_parallel": mode,
                                      "recompute": again, "step_s": pl.step_s, "bubble": pl.bubble,
                                      "tokens_per_s_per_gpu": pl.tokens_per_s_per_gpu,
                                      "memory_bytes": pl.memory_bytes, "fits": fits})
                        if fits and (best is None or pl.step_s < best.step_s):
                            best = pl
    if not table:
        raise UsageError(f"choose_pipeline: no layout of {devices} devices in stages {list(stages)} to try"
                         + (f" (refused by the schedule: {'; '.join(refused[:4])})" if refused else
                            f": none of the grids and replica counts fits {rows} batch rows in micro-batches of "
                            f"{microbatch_rows}")
                         + "; pass a larger batch, smaller microbatch_rows, other stages or schedules")
    if best is None:
        least = min(row["memory_bytes"] for row in table)
        raise MemoryLimitError(f"no pipeline layout of {devices} devices fits {format_bytes(limit)} per rank "
                               f"({len(table)} tried, the smallest needs {format_bytes(least)}); pass more devices, "
                               f"smaller micro-batches or memory_limit")
    return best, table
