"""Pipeline stages: `parallelize(model, grid=(R, C), pipeline=Pipeline(stages=S, ...))` on S*R*C ranks.

torch.distributed.pipelining cuts the model at its split points (`pipeline()`, which traces it with
torch.export; each stage is a module that keeps the original parameter names), and runs the schedule
(`PipelineStage`, `ScheduleGPipe`, `Schedule1F1B`). Each stage is then parallelized by autopar on an
R x C grid of its own: stage s holds global ranks s*R*C ... (s+1)*R*C - 1, and its program is planned,
split and run as any model's is. Between stages the boundary values (the hidden states, and what
else the next stage reads: rotary tables, masks) travel point to point from rank (r, c) of stage s to
rank (r, c) of stage s+1, whole: each stage gathers its outputs over its grid before they are sent
(`full_tensor`), and the next stage's program splits them again.

A model input that a later stage reads (labels) is taken from the call's own inputs, which every rank
passes whole (as with every autopar call), cut into the same micro-batches.

`train_step(...)` runs forward and backward of every micro-batch through the schedule and returns the
whole batch's loss on every rank; the gradients are then in `.grad` of this rank's parameter blocks.
With `labels` (a transformers model's own loss) each micro-batch's mean loss is weighted by its share
of the batch's counted tokens (labels other than -100, after the shift), so the loss and gradients are
one process's on the whole batch even where micro-batches count different numbers of tokens. With
`target=` and `loss_fn=`, the loss is the mean of the micro-batches' `loss_fn(output, target)`.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, SplitPoint, pipeline

from autopar.errors import UnsupportedError, UsageError
from autopar.parallel.module import ParallelModule
from autopar.program.build import cache_off_kwargs, compile_program
from autopar.program.guards import agree_on_plan
from passes import Grid
from passes.errors import CaptureError
from passes.options import DEFAULTS

__all__ = ["Pipeline", "PipelineModule", "SCHEDULES", "pipeline_parallelize"]

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
LATER = ("interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble", "zbv_zero_bubble", "dualpipev")
IGNORE_INDEX = -100  # transformers' label for a token that is not counted


@dataclass(frozen=True)
class Pipeline:
    """How `parallelize(..., pipeline=...)` cuts the model into stages: `stages` stages (S), run by the
    `schedule` ('gpipe' or '1f1b') over `microbatches` micro-batches (None: S) of each batch;
    `split_points`: the module paths where stages 1 .. S-1 begin (None: the repeated blocks in S
    equal runs)."""

    stages: int
    schedule: str = "1f1b"
    microbatches: int | None = None
    split_points: tuple | None = None

    def __post_init__(self):
        if not isinstance(self.stages, int) or isinstance(self.stages, bool) or self.stages < 2:
            raise UsageError(f"Pipeline(stages={self.stages!r}): expected an int >= 2 (one stage is no pipeline: "
                             f"leave pipeline out)")
        if self.schedule not in SCHEDULES:
            later = f" ({self.schedule!r} is not built yet)" if self.schedule in LATER else ""
            raise UsageError(f"Pipeline(schedule={self.schedule!r}): expected one of {tuple(SCHEDULES)}{later}")
        m = self.microbatches
        if m is not None and (not isinstance(m, int) or isinstance(m, bool) or m < 1):
            raise UsageError(f"Pipeline(microbatches={m!r}): expected a positive int, or None for one per stage")
        if self.split_points is not None:
            points = tuple(self.split_points)
            if len(points) != self.stages - 1 or not all(isinstance(p, str) for p in points):
                raise UsageError(f"Pipeline(split_points={self.split_points!r}): expected {self.stages - 1} module "
                                 f"paths (where stages 1 .. {self.stages - 1} begin), e.g. ['model.layers.16']")
            object.__setattr__(self, "split_points", points)

    @property
    def n_microbatches(self) -> int:
        return self.microbatches or self.stages


def _blocks(model: nn.Module) -> list:
    """The module paths of the model's longest run of numbered children (`model.layers.0`, ...)."""
    runs: dict = {}
    for name, _ in model.named_modules():
        m = re.match(r"^(.*)\.(\d+)$", name)
        if m:
            runs.setdefault(m.group(1), []).append(name)
    return max(runs.values(), key=len) if runs else []


def _split_points(model: nn.Module, pipe_opts: Pipeline) -> tuple:
    """The module paths where stages 1 .. S-1 begin: the given ones (checked), or the repeated blocks
    in S runs of equal length."""
    blocks, S = _blocks(model), pipe_opts.stages
    if pipe_opts.split_points is not None:
        modules = dict(model.named_modules())
        bad = [p for p in pipe_opts.split_points if p not in modules or p == ""]
        if bad:
            raise UsageError(f"Pipeline(split_points=...): {bad} {'is not a' if len(bad) == 1 else 'are not'} module "
                             f"path{'s' if len(bad) > 1 else ''} of this model; candidates (its repeated blocks): "
                             f"{blocks or sorted(modules)[:20]}")
        return pipe_opts.split_points
    if len(blocks) < S:
        raise UsageError(f"Pipeline(stages={S}) without split_points: the model has {len(blocks)} repeated blocks "
                         f"({blocks[:4]}...), fewer than the stages; pass split_points=[module paths]")
    return tuple(blocks[round(k * len(blocks) / S)] for k in range(1, S))


def _chunks(args: tuple, kwargs: dict, m: int) -> list:
    """The batch's m micro-batches: (args, kwargs) each, every tensor cut along dim 0."""
    tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor) and t.dim() > 0]
    rows = {t.shape[0] for t in tensors}
    if len(rows) != 1 or next(iter(rows)) % m:
        raise UsageError(f"pipeline: a batch of {sorted(rows)} rows cannot be cut into {m} micro-batches of equal "
                         f"size; pass a batch whose size {m} divides, or Pipeline(microbatches=...) that divides it")
    size = next(iter(rows)) // m

    def cut(v, i):
        return v[i * size:(i + 1) * size] if isinstance(v, torch.Tensor) and v.dim() > 0 else v

    return [(tuple(cut(a, i) for a in args), {k: cut(v, i) for k, v in kwargs.items()}) for i in range(m)]


def _counted(labels: torch.Tensor) -> int:
    """Tokens a causal LM's loss counts: labels after the one-token shift that are not -100."""
    return int((labels[..., 1:] != IGNORE_INDEX).sum())


class _StageRun(nn.Module):
    """What `PipelineStage` runs on this rank: the stage's ParallelModule, fed the boundary values it
    receives plus the call's own inputs the stage reads (`feeds`, one micro-batch per call), returning
    its outputs whole (gathered over the grid) for the next stage or the loss."""

    def __init__(self, pm: ParallelModule, kinds: list, first: bool, last: bool, keep, names: list):
        super().__init__()
        self.pm, self.kinds, self.first, self.last, self.keep = pm, kinds, first, last, keep
        self.names = names  # the model's forward parameters, in order: how positional inputs are named
        self.feeds: list = []

    def forward(self, *received, **given):
        log = self.pm.grid.log
        if self.first:
            given = {**dict(zip(self.names, received)), **given}
            args = tuple(given[name] for _, name in self.kinds)
        else:
            mine = self.feeds.pop(0) if any(k == "input" for k, _ in self.kinds) else {}
            it = iter(received)
            args = tuple(next(it) if k == "p2p" else mine[name] for k, name in self.kinds)
            for t in received:  # backward sends each one's gradient to the stage before
                if t.requires_grad:
                    t.register_hook(lambda g: _count(log, "bwd", g))
        out = self.pm(*args)
        out = out if isinstance(out, tuple) else (out,)
        whole = tuple(o.full_tensor() if hasattr(o, "full_tensor") else o for o in self.keep(out))
        if not self.last:  # sent to the next stage
            for t in whole:
                _count(log, "fwd", t)
        return whole if len(whole) > 1 else whole[0]


def _count(log, phase: str, t: torch.Tensor) -> None:
    """One point-to-point send of `t` to a neighbouring stage, in the grid's CommLog (tag "pp:send")."""
    log.launch("pp:send", phase)
    log.add("pp:send", phase, t.numel() * t.element_size())


class PipelineModule(nn.Module):
    """This rank's pipeline stage of a model (see the module docstring): `train_step` trains on a batch;
    `parameters()` are this stage's parameter blocks (DTensors on its grid, original names)."""

    def __init__(self, pm: ParallelModule, grid: Grid, pipe_opts: Pipeline, run: _StageRun, stage: PipelineStage,
                 labels: bool):
        super().__init__()
        self.grid, self.pipeline, self._labels = grid, pipe_opts, labels
        for name, value in (("stage_module", pm), ("_run", run), ("_stage", stage)):
            object.__setattr__(self, name, value)  # not children: the parameters keep their own names
        self.train(pm.training)

    def p2p_traffic(self) -> dict:
        """What this rank sends to its neighbouring stages per training step, {phase: (calls, bytes)}:
        forward, each output of its stage for every micro-batch (none from the last stage); backward,
        the gradient of each floating-point value it received (none from the first)."""
        m = self.pipeline.n_microbatches
        outs = () if self._run.last else self._sent
        grads = () if self._run.first else tuple(t for t in self._received if t.requires_grad)
        return {phase: (m * len(ts), m * sum(t.numel() * t.element_size() for t in ts))
                for phase, ts in (("fwd", outs), ("bwd", grads))}

    def named_parameters(self, *args, **kwargs):
        """This stage's parameters, by their names in the original model."""
        return self.stage_module.named_parameters(*args, **kwargs)

    def state_dict(self, *args, **kwargs):
        return self.stage_module.state_dict(*args, **kwargs)

    def train(self, mode: bool = True):
        super().train(mode)
        self.stage_module.train(mode)
        return self

    def _schedule(self, loss_fn):
        cls = SCHEDULES[self.pipeline.schedule]
        return cls(self._stage, self.pipeline.n_microbatches, loss_fn=loss_fn, scale_grads=False)

    def train_step(self, *args, target=None, loss_fn=None, **kwargs) -> torch.Tensor:
        """Forward and backward of every micro-batch of this batch through the schedule, on every rank
        with the same whole inputs; returns the batch's loss (a plain tensor, equal on every rank)."""
        S, m, s = self.pipeline.stages, self.pipeline.n_microbatches, self.grid.stage
        if loss_fn is None and not self._labels:
            raise UsageError("train_step: this model's output carries no loss; pass target=... and loss_fn=fn, where "
                             "fn(output, target) is a micro-batch's mean loss (or pass labels= to a transformers "
                             "model)")
        if self._labels and loss_fn is None and "labels" not in kwargs:
            raise UsageError("train_step: this pipeline was built from example inputs with labels=, so its last "
                             "stage computes the model's loss from them; pass labels=... (or target= and loss_fn=)")
        chunks = _chunks(args, kwargs, m)
        if loss_fn is None:
            labels = kwargs["labels"]
            total = _counted(labels)
            if total == 0:
                raise UsageError("train_step: every label is -100, so no token counts toward the loss")
            counts = [_counted(kw["labels"]) for _, kw in chunks]
            if 0 in counts:  # its own mean loss is 0/0: NaN in the sum, though one process's loss is defined
                raise UsageError(f"train_step: micro-batch {counts.index(0)} of {m} has no counted token (every "
                                 f"label -100 after the shift); order or pad the batch so that each micro-batch "
                                 f"counts one, or use fewer micro-batches")
            weights = iter([c / total for c in counts])

            def fn(output, _target):
                return (output[0] if isinstance(output, tuple) else output) * next(weights)
            target = torch.zeros(m)  # one placeholder per micro-batch: the weights come in order
        else:
            def fn(output, tgt):
                return loss_fn(output, tgt) / m
        self._run.feeds[:] = [{**dict(zip(self._run.names, a)), **kw} for a, kw in chunks]
        schedule, losses = self._schedule(fn), []
        if s == 0:
            schedule.step(*args, **kwargs, return_outputs=False)
        elif s == S - 1:
            schedule.step(target=target, losses=losses, return_outputs=False)
        else:
            schedule.step(return_outputs=False)
        loss = torch.stack([x.detach().float() for x in losses]).sum() if losses else torch.zeros(())
        last = dist.get_global_rank(self.grid.pp_group, S - 1)
        dist.broadcast(loss, src=last, group=self.grid.pp_group)
        return loss

    def forward(self, *args, **kwargs):
        raise UsageError("a pipelined model runs a whole batch's forward and backward at once: call "
                         "pmodel.train_step(*args, **kwargs) (forward alone through the stages is not built yet)")

    def generate(self, *args, **kwargs):
        raise UnsupportedError("generate on a pipelined model is not built; parallelize the model without "
                               "pipeline= to generate")

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """As ParallelModule's, over every stage: the total norm of all the model's gradients."""
        return self.stage_module.clip_grad_norm_(max_norm, norm_type)


def pipeline_parallelize(model: nn.Module, grid, pipe_opts: Pipeline, example_inputs: tuple, example_kwargs,
                         options, device, timeout) -> PipelineModule:
    """`parallelize(..., pipeline=pipe_opts)`: this rank's stage, parallelized on its grid (its groups built
    with `timeout`, a timedelta, as parallelize builds a grid's)."""
    if len(grid) == 3:
        raise UnsupportedError("pipeline= with data-parallel replicas (grid=(dp, R, C)) is not built; pass grid=(R, C)")
    refused = {k: v for k, v in (("strategy", options.strategy), ("compile", options.compile),
                                 ("recompute", options.recompute)) if v != getattr(DEFAULTS, k) and v != "1d"}
    if refused:
        raise UnsupportedError(f"pipeline= with {refused} is not built; leave them at their defaults "
                               f"(strategy '2d' or '1d')")
    need, world = pipe_opts.stages * grid[0] * grid[1], dist.get_world_size()
    if need != world:
        raise UsageError(f"{pipe_opts.stages} pipeline stages of grid={tuple(grid)} needs {need} processes but the "
                         f"default process group has world size {world}; start {need} processes, or change the "
                         f"stages or the grid")
    m = pipe_opts.n_microbatches
    kwargs = {**cache_off_kwargs(model), **(example_kwargs or {})}
    first_args, first_kwargs = _chunks(example_inputs, kwargs, m)[0]
    points = _split_points(model, pipe_opts)
    try:
        pipe = pipeline(model, mb_args=first_args, mb_kwargs=first_kwargs,
                        split_spec={p: SplitPoint.BEGINNING for p in points})
    except Exception as e:  # torch.export could not trace the model whole
        raise CaptureError(f"pipeline=: torch.distributed.pipelining could not split the model at {list(points)} "
                           f"({type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''})") \
            from e
    if pipe.num_stages != pipe_opts.stages:
        raise UsageError(f"pipeline=: splitting at {list(points)} gave {pipe.num_stages} stages, not "
                         f"{pipe_opts.stages}; pass split_points in the order the model runs them")
    _refuse_shared_across_stages(model, pipe)
    seen: dict = {}
    subs = [mod for name, mod in pipe.split_gm.named_children() if name.startswith("submod_")]
    hooks = [mod.register_forward_hook(lambda _m, a, o, i=i: seen.__setitem__(i, (a, o))) for i, mod in enumerate(subs)]
    try:
        reference = pipe(*first_args, **first_kwargs)
    finally:
        for h in hooks:
            h.remove()
    g = Grid(grid[0], grid[1], device_type=device.type, timeout=timeout, stages=pipe_opts.stages)
    s = g.stage
    stage_mod = pipe.get_stage_module(s)
    args, outs = seen[s]
    calls = [n for n in pipe.split_gm.graph.nodes if n.op == "call_module" and n.target.startswith("submod_")]
    kinds = [("input", a.target) if a.op == "placeholder" else ("p2p", None) for a in calls[s].args]
    args = tuple(a.detach() for a in args)
    comp, layouts = compile_program(stage_mod, args, {}, g, options)
    agree_on_plan(comp, layouts, stage_mod, group=g.world_group)
    pm = ParallelModule(stage_mod, g, comp, layouts, options)
    labels = "labels" in kwargs and isinstance(reference, tuple) and getattr(reference[0], "dim", lambda: 1)() == 0
    last = s == pipe_opts.stages - 1
    keep = (lambda out: out[:1]) if last and labels else (lambda out: out)
    outs = outs if isinstance(outs, tuple) else (outs,)
    outs = tuple(o.detach().requires_grad_(o.is_floating_point()) for o in keep(outs))
    received = tuple(a.requires_grad_(a.is_floating_point()) for a, (k, _) in zip(args, kinds) if k == "p2p")
    names = [n for n in inspect.signature(model.forward).parameters]
    run = _StageRun(pm, kinds, s == 0, last, keep, names)
    stage = PipelineStage(run, s, pipe_opts.stages, device, input_args=received if s else args,
                          output_args=outs if len(outs) > 1 else outs[0], group=g.pp_group)
    pmodel = PipelineModule(pm, g, pipe_opts, run, stage, labels)
    object.__setattr__(pmodel, "_received", received if s else ())  # examples: one micro-batch's shapes
    object.__setattr__(pmodel, "_sent", () if last else outs)
    return pmodel


def _refuse_shared_across_stages(model: nn.Module, pipe) -> None:
    """A parameter two stages read (an embedding tied to the LM head) would need its gradients summed
    across the stages: not built, refused by name."""
    owner: dict = {}
    for i in range(pipe.num_stages):
        for name, _ in pipe.get_stage_module(i).named_parameters():
            owner.setdefault(name, set()).add(i)
    first: dict = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        first.setdefault(id(p), []).append(name)
    for names in first.values():
        stages = set().union(*(owner.get(n, set()) for n in names))
        if len(names) > 1 and len(stages) > 1:
            raise UnsupportedError(f"pipeline=: parameter {names[0]!r} is shared with {names[1:]} and read by stages "
                                   f"{sorted(stages)}; weights tied across stages are not built yet (untie them, or "
                                   f"put their users in one stage with split_points)")
