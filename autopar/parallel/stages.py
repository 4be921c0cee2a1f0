"""The stages of a pipelined model (see `autopar.parallel.pipeline`): the model cut by
`autopar.program.pipe.cut`, and each of this rank's stages compiled on its grid and wrapped for torch's
`PipelineStage`.

A stage's program takes what it receives from the stage before in the layout that stage produced it
(its placeholders `PLACED`): rank (r, c) of stage i sends its own block of each boundary value to rank
(r, c) of stage i+1, and nothing is gathered at a boundary. So each stage is compiled after the one
before it: stage i receives stage i-1's output layouts (a small object sent point to point) before its
own compile, and sends its own to stage i+1 after.

A model input that a later stage reads (labels) is taken from the call's own inputs, which every rank
passes whole (as with every autopar call), cut into the same micro-batches (`feeds`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage

from autopar.parallel.module import Local, ParallelModule
from autopar.program.build import capture, compile_captured, signature
from autopar.program.guards import agree_on_plan
from autopar.program.memo import own
from autopar.program.pipe import crossings, rank_of, tied_names
from passes import Grid
from passes.capture.export import flatten_inputs
from passes.compat import pytree
from passes.cost.volumes import all_reduce_bytes
from passes.layout import REPLICATED, local_shape
from passes.meta import PLACED
from passes.ops.comm import guarded, tensor_bytes
from passes.ops.grad_buckets import plan_buckets

__all__ = ["Stage", "StageRun", "Tied", "Variant", "average_over_replicas", "build"]

def _count(log, phase: str, t: torch.Tensor) -> None:
    """One point-to-point send of `t` to a neighbouring stage, in the grid's CommLog (tag "pp:send")."""
    log.launch("pp:send", phase)
    log.add("pp:send", phase, t.numel() * t.element_size())


class Stage(PipelineStage):
    """torch's PipelineStage, whose stage's FSDP2 units (data_parallel='shard': its ParallelModule is the
    FSDP2 root, inside StageRun) keep their gradients unsharded over the micro-batches and reduce-scatter
    them once, after the step's last backward; with reshard_after_forward=False the parameters are gathered
    once per step too. (torch does this for a stage module that is itself the FSDP2 root.) Without it
    each micro-batch gathered the stage's parameters again and reduce-scattered its gradients: with 64
    micro-batches, 64 times the bytes. (Zero-bubble schedules, whose backward is split in two, still
    reduce per micro-batch.) `synced`: whether this step's last backward ran with the sync on."""

    synced = True

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward: bool = False):
        root = self.submod.pm
        if isinstance(root, FSDPModule):
            # a zero-bubble schedule's split backward (inputs' gradients, then weights'): FSDP2's hooks reduce
            # after each micro-batch, as before; only a full backward accumulates to the last one
            last = bool(last_backward) if backward_type == "full" else True
            root.set_is_last_backward(last)
            root.set_requires_gradient_sync(last)
            root.set_reshard_after_backward(last)
            self.synced = last
        return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)


class StageRun(nn.Module):
    """What `PipelineStage` runs for stage j on this rank: its program (`comp`, on the stage's
    ParallelModule), fed from the values crossing into it (`carry_in`, this rank's blocks, received from
    stage j-1) and the call's own inputs it reads (`feeds`, one micro-batch per call; stage 0 gets them
    as keywords); returns the values crossing out of it (`carry_out`: its own outputs, and those of
    earlier stages that later ones read, relayed), or from the last stage its outputs whole (for the
    loss). A value is (stage that made it, output index), or ("input", name)."""

    def __init__(self, pm: ParallelModule, comp, j: int, needs: list, carry_in: list, carry_out: list,
                 last: bool, loss_at: int | None):
        super().__init__()
        self.pm, self.comp, self.j, self.needs, self.last, self.loss_at = pm, comp, j, needs, last, loss_at
        self.carry_in, self.carry_out = carry_in, carry_out
        self.feeds: list = []

    def forward(self, *received, **given):
        log = self.pm.grid.log
        mine = given if self.j == 0 else (self.feeds.pop(0) if any(v[0] == "input" for v in self.needs) else {})
        for t in received:  # backward sends each one's gradient to the stage before
            if t.requires_grad:
                t.register_hook(lambda g: _count(log, "bwd", g))
        have = dict(zip(self.carry_in, received))
        args = tuple(mine[v[1]] if v[0] == "input" else have[v] for v in self.needs)
        leaves = self.pm(Local(self.comp, flatten_inputs(self.comp.captured, args, {})))
        if self.last:  # whole, for the loss (or an eval forward's result)
            out = pytree.tree_leaves(self.pm.outputs_of(self.comp, leaves))
            out = out if self.loss_at is None else [out[self.loss_at]]
            out = [o.full_tensor() if hasattr(o, "full_tensor") else o for o in out]
        else:
            out = [leaves[v[1]] if v[0] == self.j else have[v] for v in self.carry_out]
            for t in out:
                _count(log, "fwd", t)
        return tuple(out) if len(out) > 1 else out[0]


@dataclass
class Variant:
    """This rank's stages for one kind of call (train or eval, one micro-batch shape): a StageRun and a
    PipelineStage each, in stage order; `reference` is the model's output on the first micro-batch
    (its structure and shapes, for an eval forward's result)."""

    runs: list
    stages: list
    reference: object
    sent: list = field(default_factory=list)  # per local stage: examples of what it sends, one micro-batch
    tied: dict = field(default_factory=dict)  # stage -> {name of a tied weight it reads: the weight's first name}
    received: list = field(default_factory=list)  # per local stage: examples of what it receives
    loss_at: int | None = None
    share: object = None


def build(model: nn.Module, pipe, seen: dict, reference, g: Grid, ids: list, style: str, loss_at: int | None,
          options, device, training: bool, pms: dict) -> Variant:
    """This rank's stages `ids` of `pipe` (cut by `cut`; placed on the ranks in `style`, see `rank_of`):
    each compiled on grid `g` (what it receives placed as the stage before sends it), on its
    ParallelModule in `pms` (stage index -> module; made here when missing, on the first build, whose
    plan every rank of the grid checks), and wrapped for PipelineStage. `loss_at`: the last stage
    returns this output leaf alone (the model's own loss), or None: all of them."""
    n, at = pipe.num_stages, (g.r, g.c)
    needs, crossing = crossings(pipe)
    variant = Variant([], [], reference, loss_at=loss_at)
    mailbox: dict = {}  # stage -> what it sends to the next stage, where that stage is on this rank
    tied_to = tied_names(model)  # each name of a tensor the model holds under several -> its first name

    def whole(v):  # the full value (one micro-batch) a value id names
        out = seen[v[0]][1]
        return out[v[1]] if isinstance(out, tuple) else out

    for j in ids:
        stage_mod = own(pipe.get_stage_module(j))  # a dry run's ranks share one cut: each changes its own copy
        stage_mod.train(training)
        carry_in = crossing[j - 1] if j else []
        carry_out = crossing[j] if j < n - 1 else []
        args = seen[j][0]  # a received value that needs a gradient is captured needing one: its backward is built
        # from the stage before: its blocks' layouts, and the layout of each tied weight placed so far
        boundary, tied = (mailbox.pop(j - 1) if j - 1 in mailbox else _receive(g, rank_of(j - 1, g.stages, style))) \
            if j else ([], {})
        lay = dict(zip(carry_in, boundary))
        first_build = j not in pms
        cap, reads = _capture(stage_mod, args, needs[j], lay)
        unread = [nm for nm, _ in stage_mod.named_parameters() if nm in tied_to and nm not in reads]
        if unread:  # a tied copy the stage never reads (torch's cut keeps one): not held
            for name in unread:
                parent, _, leaf = name.rpartition(".")
                delattr(stage_mod.get_submodule(parent), leaf)
            cap, reads = _capture(stage_mod, args, needs[j], lay)
        mine = {name: tied_to[name] for name in reads if name in tied_to}  # tied weights this stage reads
        variant.tied[j] = mine
        # a tied weight's copy here takes the layout of its first stage's copy (their gradients add up)
        pinned = {name: tied[first] for name, first in mine.items() if first in tied} if first_build \
            else dict(pms[j].param_layouts)
        choice = None if first_build else pms[j].choice  # strategy='auto': later builds repeat the first's
        comp, layouts = compile_captured(cap, signature(args, {}, training), g, options, choice, pinned)
        if first_build:
            agree_on_plan(comp, layouts, stage_mod, group=g.world_group)
            pms[j] = ParallelModule(stage_mod, g, comp, layouts, options)
        tied = {**{first: pms[j].param_layouts[name] for name, first in mine.items()}, **tied}
        last = j == n - 1
        lay.update(((j, k), o[0] if o else REPLICATED) for k, o in enumerate(comp.out_layouts))
        message = ([lay[v] for v in carry_out], tied)
        if j + 1 in ids:  # the next stage is this rank's too ('v' placement)
            mailbox[j] = message
        elif not last:
            _send(g, message, rank_of(j + 1, g.stages, style))

        sent, received = ([_block(whole(v), lay[v], g, at) for v in vs] for vs in (carry_out, carry_in))
        outs = seen[j][1] if isinstance(seen[j][1], tuple) else (seen[j][1],)
        out_args = (list(outs) if loss_at is None else [outs[loss_at]]) if last else sent
        run = StageRun(pms[j], comp, j, needs[j], carry_in, carry_out, last, loss_at)
        stage = Stage(run, j, n, device, input_args=tuple(received),
                      output_args=out_args[0] if len(out_args) == 1 else tuple(out_args), group=g.pp_group)
        variant.runs.append(run)
        variant.stages.append(stage)
        variant.sent.append(sent)
        variant.received.append(received)
    return variant


def _capture(stage_mod, args: tuple, needs: list, lay: dict) -> tuple:
    """(the stage captured with its received values `PLACED` in `lay`'s layouts, the parameters it reads)."""
    cap = capture(stage_mod, args, {})
    reads = set()
    for node, (role, key) in zip(cap.gm.graph.find_nodes(op="placeholder"), cap.sources):
        if role == "input" and needs[key] in lay:
            node.meta[PLACED] = lay[needs[key]]
        if role == "param" and node.users:
            reads.add(key)
    return cap, reads


def _block(t: torch.Tensor, lay, g: Grid, at) -> torch.Tensor:
    """An example of this rank's block of `t` in layout `lay` (zeros of its block's shape, needing a
    gradient where `t` does: PipelineStage reads that to know which gradients cross back)."""
    block = torch.zeros(local_shape(tuple(t.shape), lay, g.shape, at=at), dtype=t.dtype, device=t.device)
    return block.requires_grad_(t.requires_grad)


def _send(g: Grid, message, to: int) -> None:
    with guarded(g, "send of the stage's output layouts to the next stage", "pp", "parallelize"):
        dist.send_object_list([message], group_dst=to, group=g.pp_group)


def _receive(g: Grid, src: int):
    box: list = [None]
    with guarded(g, "receive of the output layouts of the stage before", "pp", "parallelize"):
        dist.recv_object_list(box, group_src=src, group=g.pp_group)
    return box[0]


def average_over_replicas(pms: list, g: Grid, bucket_mb: float) -> None:
    """After a step's last backward: this rank's accumulated gradients averaged over the dp replicas,
    one all-reduce per bucket of at most `bucket_mb` MiB of one dtype (counted under "dp:pp<b>"). Once
    per step, not once per micro-batch, as the stages' own programs would (their replica sync is off)."""
    grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
             for pm in pms for p in pm.parameters() if p.grad is not None]
    for b, slots in enumerate(plan_buckets([(t.element_size(), t.numel(), t.dtype) for t in grads],
                                           bucket_mb * 2**20)):
        flat = torch.cat([grads[i].reshape(-1) for i in slots])
        tag = f"dp:pp{b}"
        g.log.add(tag, "bwd", all_reduce_bytes(tensor_bytes(flat), g.dp))
        g.log.launch(tag, "bwd")
        with guarded(g, "all-reduce", "dp", tag):
            dist.all_reduce(flat, group=g.dp_group)
        flat.div_(g.dp)
        offset = 0
        for i in slots:
            grads[i].copy_(flat[offset:offset + grads[i].numel()].view_as(grads[i]))
            offset += grads[i].numel()


class Tied:
    """The weights the model ties across stages (each stage holds its own copy, all in one layout): after
    a step's backward, each copy's gradient becomes the sum of all copies' (one all-reduce per weight
    over the pipeline ranks holding them, rank (r, c) with rank (r, c)); the norm counts the first."""

    def __init__(self, grid: Grid, reads: dict, ids: list, style: str, timeout):
        """`reads`: this rank's stages' {stage: {name read: first name}} (`Variant.tied`), gathered from
        every pipeline rank here to know where each weight's copies are."""
        everyone: list = [None] * grid.stages
        with guarded(grid, "all-gather of the weights each stage ties", "pp", "parallelize"):
            dist.all_gather_object(everyone, reads, group=grid.pp_group)
        where: dict = {}  # first name -> {stage: name}
        for r in everyone:
            for j, names in r.items():
                for name, first in names.items():
                    where.setdefault(first, {})[j] = name
        self.grid = grid
        self.local: dict = {}  # first name -> this rank's copies' names
        self.groups: dict = {}  # first name -> the process group of the pipeline ranks holding it (None: here)
        self.secondary: set = set()  # names of copies the norm does not count (not the first stage's)
        self.copies: dict = {}  # this rank's secondary copies -> their first stage's name
        width, pos = grid.dp * grid.world, grid.dp_index * grid.world + grid.r * grid.shape[1] + grid.c
        for first in sorted(where):
            stages = where[first]
            if len(stages) < 2:
                continue
            ranks = sorted({rank_of(j, grid.stages, style) for j in stages})
            self.local[first] = [name for j, name in stages.items() if j in ids]
            head = min(stages)  # the first stage holding a copy
            self.secondary |= {name for j, name in stages.items() if j != head}
            self.copies.update({name: stages[head] for j, name in stages.items() if j != head and j in ids})
            self.groups[first] = None
            if len(ranks) > 1:  # every rank creates every group, in the same order
                for i in range(width):
                    group = dist.new_group([p * width + i for p in ranks], timeout=timeout)
                    if i == pos and grid.stage in ranks:
                        self.groups[first] = group

    def sum_gradients(self, pms: list) -> None:
        params = {n: p for pm in pms for n, p in pm.named_parameters()}
        for first, names in self.local.items():
            grads = [params[n].grad for n in names if n in params]
            if not grads:
                continue
            total = sum(g.to_local() if hasattr(g, "to_local") else g for g in grads if g is not None)
            if not isinstance(total, torch.Tensor):
                continue
            if self.groups[first] is not None:
                with guarded(self.grid, "all-reduce of a tied weight's gradient over its stages", "pp", first):
                    dist.all_reduce(total, group=self.groups[first])
            for g in grads:
                if g is not None:
                    (g.to_local() if hasattr(g, "to_local") else g).copy_(total)
