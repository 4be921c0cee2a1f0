"""Pipeline stages: `parallelize(model, grid=(R, C), pipeline=Pipeline(stages=S, ...))` on S*R*C ranks.

torch.distributed.pipelining cuts the model at its split points (`pipeline()`, which traces it with
torch.export; each stage is a module that keeps the original parameter names), and runs the schedule
(`PipelineStage` and torch's schedules: GPipe, 1F1B, interleaved 1F1B, looped breadth-first, the zero
bubble ones). Each stage is then parallelized by autopar on an R x C grid of its own: pipeline rank p
holds global ranks p*R*C ... (p+1)*R*C - 1, and its stages' programs are planned, split and run as any
model's is. With `stages_per_rank` V > 1 the model is cut into S*V stages and pipeline rank p holds
stages p, p+S, ... (the 'v' schedules: p and 2S-1-p). Between stages the boundary values (the hidden
states, and what else the next stage reads: rotary tables, masks) travel point to point from rank
(r, c) of one stage to rank (r, c) of the next in their 2D layout: each rank sends its own block and
nothing is gathered (`autopar.parallel.stages`).

`train_step(...)` runs forward and backward of every micro-batch through the schedule and returns the
whole batch's loss on every rank; the gradients are then in `.grad` of this rank's parameter blocks.
A model that returns its own loss (a transformers model given `labels`, or any model with one 0-dim
floating-point output, first or alone) is trained on it: each micro-batch's loss is weighted by its
share of what the loss counts, read from the loss itself (`autopar.program.loss_share`: the targets a
cross-entropy does not ignore, after a causal LM's shift or without one, one per row for a sequence
classifier; equal shares for an elementwise loss), so the loss and gradients are one process's on the
whole batch even where micro-batches count different numbers of targets; a loss it cannot read is
refused. With `target=` and `loss_fn=`, the loss is the mean of the micro-batches' `loss_fn(output,
target)`.
`pmodel(...)` in eval mode runs the stages forward and returns the last stage's outputs on every rank.
A call with another micro-batch shape or mode cuts and compiles the stages for it once (cached).
"""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist
import torch.nn as nn

from autopar.errors import AutoparError, PlanWarning, TorchVersionError, UnsupportedError, UsageError
from autopar.parallel.clip import clip_grad_norm
from autopar.parallel.module import save_pretrained_extension, set_path
from autopar.parallel.sharded import is_sharded, shard_replicas
from autopar.parallel.stages import Tied, Variant, average_over_replicas, build
from autopar.program.build import signature
from autopar.program.consensus import agree
from autopar.program.loss_share import LossShare, loss_leaf, loss_share
from autopar.program.pipe import (SCHEDULES, Pipeline, chunks, crossings, cut, named, rank_of, split_points,
                                  stage_ids, tied_names)
from passes import Grid
from passes.compat import IncompatibleKeys, pytree
from passes.mesh import warn
from passes.ops.comm import guarded, wait

__all__ = ["PipelineModule", "pipeline_parallelize"]

class PipelineModule(nn.Module):
    """This rank's pipeline stages of a model (see the module docstring): `train_step` trains on a batch;
    `parameters()` are its stages' parameter blocks (DTensors on its grid, original names)."""

    def __init__(self, model: nn.Module, grid: Grid, pipe_opts: Pipeline, pms: dict, first: tuple, setup: tuple):
        super().__init__()
        self.grid, self.pipeline = grid, pipe_opts
        share = first[1].share  # the model inputs its loss reads (labels), which a training step must pass
        self._loss_inputs = share.inputs if isinstance(share, LossShare) else ()
        self._ids = sorted(pms)
        self._setup = setup  # (split points, options, device): what a new variant is built with
        for name, value in (("_source", model), ("_pms", pms), ("_variants", dict([first])), ("_trained", first[1])):
            object.__setattr__(self, name, value)  # not children: their modules' names are the stages'
        # the stages' parameters and buffers (the same tensors) under their names in the original model, so
        # that optimizers, state_dict and torch.distributed.checkpoint see one model with its own names
        for pm in self.stage_modules:
            persistent = pm.persistent_buffer_names
            for kind, items in (("param", pm.named_parameters()), ("buffer", pm.named_buffers())):
                for name, value in items:
                    set_path(self, name, value, kind, name in persistent)
        self.train(model.training)

    @property
    def stage_modules(self) -> list:
        """This rank's stages, each a ParallelModule on its grid, in stage order."""
        return [self._pms[i] for i in self._ids]

    @property
    def stage_ids(self) -> list:
        """The indices (of pipeline.total) of this rank's stages."""
        return list(self._ids)

    @property
    def stage_module(self) -> nn.Module:
        """This rank's first stage."""
        return self._pms[self._ids[0]]

    def p2p_traffic(self) -> dict:
        """What this rank sends to its neighbouring stages per training step (the training variant built
        first), {phase: (calls, bytes)}: forward, its block of each output of each of its stages for every
        micro-batch (none from the last stage); backward, the gradient of each floating-point block it
        received (none from the first)."""
        m, v = self.pipeline.n_microbatches, self._trained
        outs = [t for ts in v.sent for t in ts]
        grads = [t for ts in v.received for t in ts if t.requires_grad]
        return {phase: (m * len(ts), m * sum(t.numel() * t.element_size() for t in ts))
                for phase, ts in (("fwd", outs), ("bwd", grads))}

    @property
    def schedule_stages(self) -> list:
        """torch's PipelineStage objects this rank's stages run under in training (the training variant
        built first), in stage order: for instrumentation, as `autopar bench --pipeline` times them."""
        return list(self._trained.stages)

    @property
    def source_model(self) -> nn.Module:
        """The model this was built from (unchanged, not a child module)."""
        return self._source

    @property
    def persistent_buffer_names(self) -> frozenset:
        return frozenset().union(*(pm.persistent_buffer_names for pm in self.stage_modules))

    def save_pretrained(self, path, **kwargs) -> None:
        """`autopar.save_pretrained(self, path, **kwargs)`: call it on every rank."""
        save_pretrained_extension(self, path, **kwargs)

    @property
    def tied_copies(self) -> dict:
        """Each copy this rank holds of a weight tied across stages, other than the first stage's -> the
        first stage's name (GPT-2: {'lm_head.weight': 'transformer.wte.weight'} on the last stage)."""
        return self._tied.copies

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """From plain full tensors (a single-process model's state_dict, the same on every rank) or from
        this rank's own state_dict: each of this rank's stages takes its keys (a copy of a weight tied
        across stages, under either of its names) and keeps its block of each; the other stages' keys
        are skipped, and buffers the model does not save (rotary tables) are not required. With
        `strict`, keys of this rank's stages that are missing, or keys of no stage of the model, raise a
        UsageError on every rank before anything loads. Call it on every rank."""
        known = set(self._source.state_dict().keys())
        aliases: dict = {}  # each name of a tied weight -> all its names
        for name, first in tied_names(self._source).items():
            aliases.setdefault(first, []).append(name)
        names_of = {n: aliases[first] for first in aliases for n in aliases[first]}
        own = [list(pm.state_dict()) for pm in self.stage_modules]  # each stage's keys
        held = {n for names in own for n in names}
        subs, missing = [], []
        for names in own:
            sub = {}
            for name in names:
                given = next((n for n in (name, *names_of.get(name, ())) if n in state_dict), None)
                if given is not None:
                    sub[name] = state_dict[given]
                elif name in known:  # a buffer the model does not save is not asked for
                    missing.append(name)
            subs.append(sub)
        unexpected = [k for k in state_dict if k not in known and k not in held]
        failure = None
        if strict and (missing or unexpected):
            failure = UsageError(
                f"load_state_dict into pipeline rank {self.grid.stage}'s stages {self.stage_ids}: "
                + (f"missing {missing[:8]}{' ...' if len(missing) > 8 else ''}; " if missing else "")
                + (f"keys of no stage of this model {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}; "
                   if unexpected else "")
                + "pass the whole model's state_dict (a one-process model's), or strict=False")
        agree(self.grid, failure, "load_state_dict")
        for pm, sub in zip(self.stage_modules, subs):
            pm.load_state_dict(sub, strict=False, assign=assign)
        return IncompatibleKeys(missing, unexpected)

    def train(self, mode: bool = True):
        super().train(mode)
        for pm in self.stage_modules:
            pm.train(mode)
        return self

    def _variant(self, kwargs: dict, training: bool, own_loss: bool = False) -> Variant:
        """This rank's stages for a call of this batch's micro-batch shape and mode (built on first use);
        `own_loss`: the last stage returns the model's own loss alone (a training step without loss_fn)."""
        first_args, first_kwargs = chunks((), kwargs, self.pipeline.n_microbatches)[0]
        key = (signature(first_args, first_kwargs, training), own_loss)
        if key not in self._variants:
            points, options, device = self._setup
            model, was = self._source, self._source.training
            model.train(training)
            try:
                pipe, seen, ref = cut(model, points, first_args, first_kwargs, self.pipeline.total)
            finally:
                model.train(was)
            self._variants[key] = _built(model, first_kwargs, pipe, seen, ref, self.grid, self._ids,
                                         self.pipeline.style, own_loss, options, device, training, self._pms)
        return self._variants[key]

    def _named(self, args: tuple, kwargs: dict) -> dict:
        """The call's inputs by name (positional ones named as the model's forward names them)."""
        return named(self._source, args, kwargs)

    def _schedule(self, variant: Variant, loss_fn):
        cls, style = SCHEDULES[self.pipeline.schedule]
        stages = variant.stages[0] if style == "one" else variant.stages
        try:
            return cls(stages, self.pipeline.n_microbatches, loss_fn=loss_fn, scale_grads=False)
        except ValueError as e:  # torch's own constraint on the micro-batches (interleaved: rounds)
            raise UsageError(f"Pipeline(schedule={self.pipeline.schedule!r}, microbatches="
                             f"{self.pipeline.n_microbatches}, stages={self.pipeline.stages}): {e}") from e

    def _run(self, variant: Variant, kwargs, fn, target, losses: list) -> None:
        """One step of the schedule: forward and backward of every micro-batch."""
        m, n = self.pipeline.n_microbatches, self.pipeline.total
        for run in variant.runs:
            run.feeds[:] = [kw for _, kw in chunks((), kwargs, m)]
        schedule = self._schedule(variant, fn)
        has_first, has_last = 0 in self._ids, n - 1 in self._ids
        with torch.enable_grad(), guarded(self.grid, "pipeline schedule's point-to-point sends and receives", "pp",
                                          f"train_step ({self.pipeline.schedule})"):
            schedule.step(**(kwargs if has_first else {}), target=target if has_last else None,
                          losses=losses if has_last else None, return_outputs=False)

    def _last_rank(self) -> int:
        return dist.get_global_rank(self.grid.pp_group, rank_of(self.pipeline.total - 1, self.pipeline.stages,
                                                                self.pipeline.style))

    def train_step(self, *args, target=None, loss_fn=None, **kwargs) -> torch.Tensor:
        """Forward and backward of every micro-batch of this batch through the schedule, on every rank
        with the same whole inputs; returns the batch's loss (a plain tensor, equal on every rank)."""
        m = self.pipeline.n_microbatches
        if not self.training:
            raise UsageError("train_step on a model in eval mode: call pmodel.train() first (or pmodel(...) for an "
                             "eval forward)")
        kwargs = self._named(args, kwargs)
        missing = [k for k in self._loss_inputs if k not in kwargs]
        if loss_fn is None and missing:
            raise UsageError(f"train_step: this pipeline was built from example inputs with "
                             f"{', '.join(k + '=' for k in missing)}, which its last stage computes the model's loss "
                             f"from; pass {', '.join(k + '=...' for k in missing)} (or target= and loss_fn=)")
        variant = self._variant(kwargs, True, own_loss=loss_fn is None)
        if loss_fn is None:
            if variant.loss_at is None:
                raise UsageError("train_step: this model's output carries no loss (no 0-dim floating-point output for "
                                 "these inputs); pass target=... and loss_fn=fn, where fn(output, target) is a "
                                 "micro-batch's mean loss (or pass labels= to a transformers model)")
            def fn(output, weight):  # weight: this micro-batch's (the target is the weights, one per micro-batch)
                return (output * weight.reshape(())).to(output.dtype)
            target = _weights(variant, kwargs, m)  # float64 [m] on the device: no host read
        else:
            def fn(output, tgt):
                return loss_fn(output, tgt) / m
        losses: list = []
        self._run(variant, kwargs, fn, target, losses)
        if not all(stage.synced for stage in variant.stages):
            raise AutoparError(f"train_step: the schedule ({self.pipeline.schedule}) never marked a stage's last "
                               f"backward, so its FSDP2 gradients were not reduce-scattered; this is a bug in "
                               f"autopar's pipeline for torch {torch.__version__}: please report it")
        self._tied.sum_gradients(self.stage_modules)  # a weight tied across stages: its copies' gradients add
        if self.grid.dp > 1 and not self.sharded:
            average_over_replicas(self.stage_modules, self.grid, self.stage_module.options.grad_bucket_mb)
        loss = torch.stack([x.detach().float() for x in losses]).sum() if losses else \
            torch.zeros((), device=self._setup[2])  # on the device: NCCL refuses a CPU tensor
        with guarded(self.grid, "broadcast of the loss from the last stage", "pp", "train_step"):
            dist.broadcast(loss, src=self._last_rank(), group=self.grid.pp_group)
        return loss

    def forward(self, *args, **kwargs):
        """In eval mode: the stages' forward on every micro-batch (each rank runs its stages micro-batch by
        micro-batch, receiving from the stage before and sending on without waiting), the last stage's
        outputs (its micro-batches joined along dim 0; a 0-dim loss as the whole batch's) returned on
        every rank."""
        if self.training:
            raise UsageError("a pipelined model in training mode runs a whole batch's forward and backward at once: "
                             "call pmodel.train_step(*args, **kwargs) (or pmodel.eval() for a forward alone)")
        m, n, S, style = self.pipeline.n_microbatches, self.pipeline.total, self.pipeline.stages, self.pipeline.style
        kwargs = self._named(args, kwargs)
        variant, pp = self._variant(kwargs, False), self.grid.pp_group
        local, pending, per = {}, [], []
        with torch.no_grad():
            for i, (_, kw) in enumerate(chunks((), kwargs, m)):
                for run, examples in zip(variant.runs, variant.received):
                    j = run.j
                    if j == 0:
                        out = run(**kw)
                    else:
                        got = local.pop((i, j - 1), None)
                        if got is None:
                            got = [torch.empty_like(e, requires_grad=False) for e in examples]
                            with guarded(self.grid, "receive from the stage before", "pp", "eval forward"):
                                for t in got:
                                    dist.recv(t, group_src=rank_of(j - 1, S, style), group=pp)
                        run.feeds[:] = [kw]
                        out = run(*got)
                    out = list(out) if isinstance(out, tuple) else [out]
                    if j == n - 1:
                        per.append(out)
                    elif j + 1 in self._ids:
                        local[(i, j)] = out
                    else:
                        pending += [dist.isend(t.contiguous(), group_dst=rank_of(j + 1, S, style), group=pp)
                                    for t in out]
            for work in pending:
                wait(work, self.grid, "send to the next stage", "pp", "eval forward")
        ref = pytree.tree_leaves(variant.reference)
        if per:
            weights = _weights(variant, kwargs, m).unbind() if isinstance(variant.share, LossShare) else [1 / m] * m
            leaves = [sum((w * p[j]).to(p[j].dtype) for w, p in zip(weights, per)) if r.dim() == 0 else
                      torch.cat([p[j] for p in per]) for j, r in enumerate(ref)]
        else:
            leaves = [torch.empty((r.shape[0] * m, *r.shape[1:]) if r.dim() else (), dtype=r.dtype,
                                  device=r.device) for r in ref]
        with guarded(self.grid, "broadcast of the last stage's outputs", "pp", "eval forward"):
            for t in leaves:
                dist.broadcast(t, src=self._last_rank(), group=pp)
        return pytree.tree_unflatten(leaves, pytree.tree_flatten(variant.reference)[1])

    def generate(self, *args, **kwargs):
        raise UnsupportedError("generate on a pipelined model is not built; parallelize the model without "
                               "pipeline= to generate")

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """As ParallelModule's, over every stage: the total norm of all the model's gradients."""
        second = {id(p) for n, p in self.named_parameters() if n in self._tied.secondary}
        return clip_grad_norm(self, max_norm, norm_type, sharded=self.sharded, uncounted=frozenset(second))

    @property
    def sharded(self) -> bool:
        """Whether the stages' grid blocks are split over the replicas (data_parallel='shard', dp > 1)."""
        return is_sharded(self.stage_module)


def pipeline_parallelize(model: nn.Module, spec, example_inputs: tuple, example_kwargs, options, device,
                         timeout) -> PipelineModule:
    """`parallelize(..., pipeline=...)`: this rank's stages of `spec` (`autopar.program.spec.ParallelSpec`),
    parallelized on its grid (its groups built with `timeout`, a timedelta, as parallelize builds a grid's)."""
    grid, pipe_opts, dp = spec.grid, spec.pipeline, spec.dp
    if tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) < (2, 13):
        raise TorchVersionError(
            f"autopar pipelines need torch >= 2.13 (this is {torch.__version__}): torch 2.11's PipelineStage asks "
            f"for gradients of every tensor crossing a stage boundary, integer masks and position ids included, "
            f"and fails ('only Tensors of floating point dtype can require gradients'; 2.12 not checked). Upgrade "
            f"torch, or parallelize without pipeline= (tensor parallelism and replicas run on 2.11)")
    need, world = spec.world, dist.get_world_size()
    if need != world:
        raise UsageError(f"{pipe_opts.stages} pipeline stages of grid={tuple(grid)} needs {need} processes but the "
                         f"default process group has world size {world}; start {need} processes, or change the "
                         f"stages or the grid")
    m, n = pipe_opts.n_microbatches, pipe_opts.total
    kwargs = named(model, example_inputs, example_kwargs or {})
    first_args, first_kwargs = chunks((), kwargs, m)[0]
    points = split_points(model, pipe_opts.split_points, n)
    pipe, seen, reference = cut(model, points, first_args, first_kwargs, n)
    g = Grid(grid[-2], grid[-1], dp=dp, device_type=device.type, timeout=timeout, stages=pipe_opts.stages)
    ids = stage_ids(g.stage, pipe_opts.stages, pipe_opts.stages_per_rank, pipe_opts.style)
    pms: dict = {}
    variant = _built(model, first_kwargs, pipe, seen, reference, g, ids, pipe_opts.style, model.training, options,
                     device, model.training, pms)
    for pm in pms.values():
        if pm.program.data_parallel == "shard":  # FSDP2 units over the replicas, each stage on its own
            shard_replicas(pm)
        pm.replica_sync = False  # replicated: averaged once per step, after the schedule (train_step)
    key = (signature(first_args, first_kwargs, model.training), model.training)
    pmodel = PipelineModule(model, g, pipe_opts, pms, (key, variant), (points, options, device))
    object.__setattr__(pmodel, "_tied", Tied(g, variant.tied, ids, pipe_opts.style, timeout))
    pmodel._schedule(variant, None)  # torch's own checks of the micro-batches, here rather than at the first step
    return pmodel


def _built(model, kwargs: dict, pipe, seen, reference, g: Grid, ids: list, style: str, own_loss: bool, options,
           device, training: bool, pms: dict) -> Variant:
    """`build` of a cut (of a call with inputs `kwargs`), with the model's own loss (where `own_loss` and its
    output has one) returned alone by the last stage, and the rule of how its micro-batches' losses add up.
    A forward that takes `labels` (transformers' convention) has its own loss only when given them: without,
    a 0-dim output is something else (a mixture of experts' auxiliary loss)."""
    takes_labels = "labels" in inspect.signature(model.forward).parameters
    at = None if takes_labels and kwargs.get("labels") is None else loss_leaf(reference)
    variant = build(model, pipe, seen, reference, g, ids, style, at if own_loss else None, options, device,
                    training, pms)
    if at is not None:
        needs, _ = crossings(pipe)
        inputs = [v[1] if v[0] == "input" else None for v in needs[-1]]
        try:
            variant.share = loss_share(pipe.get_stage_module(pipe.num_stages - 1), at, inputs)
        except UsageError as e:  # raised by a training step that needs it, not by one given loss_fn
            variant.share = e
        if own_loss and getattr(variant.share, "others", ()):
            warn(f"pipeline: the model's loss adds {list(variant.share.others)} to {variant.share.what}; they are "
                 f"weighed by its counted targets and computed per micro-batch, as gradient accumulation computes "
                 f"them, so the loss and gradients differ from one process's on the whole batch", PlanWarning,
                 stacklevel=4)
    return variant


def _weights(variant: Variant, kwargs: dict, m: int) -> list:
    """Each micro-batch's weight in the batch's loss (see `autopar.program.loss_share`)."""
    if not isinstance(variant.share, LossShare):
        raise variant.share
    return variant.share.weights([kw for _, kw in chunks((), kwargs, m)])
