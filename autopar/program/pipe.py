"""A pipeline's options and how the model is cut into stages, shared by `parallelize(..., pipeline=...)`
(`autopar.parallel.pipeline`, which runs the stages) and `autopar.plan(..., pipeline=...)` (which
prices them on one process).

`cut` is torch's `pipeline()` (torch.distributed.pipelining, an export of the model split at the
split points) with the user's modules restored after it; `crossings` says which values each stage
reads and which cross each boundary (a value a later stage reads is relayed by the stages between).
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.pipelining import (Schedule1F1B, ScheduleDualPipeV, ScheduleGPipe, ScheduleInterleaved1F1B,
                                          ScheduleInterleavedZeroBubble, ScheduleLoopedBFS, ScheduleZBVZeroBubble,
                                          SplitPoint, pipeline)

from autopar.errors import UsageError
from autopar.program.build import cache_off_kwargs, signature
from autopar.program.memo import shared
from passes.capture.export import no_stack_traces
from passes.compat import detect_fake_mode, pytree
from passes.errors import CaptureError
from passes.nodes import repeated_blocks

__all__ = ["Pipeline", "SCHEDULES", "blocks", "chunks", "crossings", "cut", "named",
           "rank_of", "schedule_refusal", "split_points", "stage_ids", "tied_names"]

# name -> (torch's schedule, stages on each pipeline rank: 'one', 'loop' (p, p+S, ...) or 'v' (p, 2S-1-p))
SCHEDULES = {"gpipe": (ScheduleGPipe, "one"), "1f1b": (Schedule1F1B, "one"),
             "interleaved_1f1b": (ScheduleInterleaved1F1B, "loop"), "looped_bfs": (ScheduleLoopedBFS, "loop"),
             "interleaved_zero_bubble": (ScheduleInterleavedZeroBubble, "loop"),
             "zbv_zero_bubble": (ScheduleZBVZeroBubble, "v"), "dualpipev": (ScheduleDualPipeV, "v")}


def schedule_refusal(schedule: str, stages: int, per_rank: int, microbatches: int) -> str | None:
    """Why torch's `schedule` refuses `microbatches` micro-batches over `stages` pipeline ranks of
    `per_rank` stages each (its constructors' checks, torch 2.11-2.14), or None where it accepts them:
    1F1B needs at least one per stage, DualPipeV one per stage of the S*V, and the looped schedules
    that run in rounds of S (interleaved 1F1B, interleaved zero bubble) a multiple of the rounds."""
    total = stages * per_rank
    if schedule == "1f1b" and microbatches < stages:
        return f"1F1B needs microbatches >= stages ({microbatches} < {stages})"
    if schedule == "dualpipev" and microbatches < total:
        return f"DualPipeV needs microbatches >= stages x stages_per_rank ({microbatches} < {total})"
    rounds = max(1, microbatches // stages)
    if schedule in ("interleaved_1f1b", "interleaved_zero_bubble") and microbatches % rounds:
        return (f"{schedule} runs micro-batches in rounds of {stages} and needs microbatches to be a multiple of "
                f"its {rounds} rounds ({microbatches} is not)")
    return None


@dataclass(frozen=True)
class Pipeline:
    """How `parallelize(..., pipeline=...)` cuts the model into stages: `stages` pipeline ranks (S), each
    holding `stages_per_rank` stages (V; the model is cut into S*V), run by the `schedule` (a name in
    `SCHEDULES`: 'gpipe' and '1f1b' one stage per rank; 'interleaved_1f1b', 'looped_bfs' (breadth-first)
    and 'interleaved_zero_bubble' V >= 1 looped stages; 'zbv_zero_bubble' and 'dualpipev' V = 2 in a V)
    over `microbatches` micro-batches (None: S, or S*V for 'dualpipev', the fewest each accepts) of each
    batch; `split_points`: the module paths where
    stages 1 .. S*V-1 begin (None: the repeated blocks in S*V equal runs)."""

    stages: int
    schedule: str = "1f1b"
    microbatches: int | None = None
    split_points: tuple | None = None
    stages_per_rank: int = 1

    def __post_init__(self):
        def positive(v):
            return isinstance(v, int) and not isinstance(v, bool) and v >= 1

        if not positive(self.stages) or self.stages < 2:
            raise UsageError(f"Pipeline(stages={self.stages!r}): expected an int >= 2 (one stage is no pipeline: "
                             f"leave pipeline out)")
        if self.schedule not in SCHEDULES:
            raise UsageError(f"Pipeline(schedule={self.schedule!r}): expected one of {tuple(SCHEDULES)}")
        V, style = self.stages_per_rank, SCHEDULES[self.schedule][1]
        if not positive(V) or (style == "one" and V != 1) or (style == "v" and V != 2):
            want = {"one": "1 (use 'interleaved_1f1b' or 'looped_bfs' for more)", "v": "2 (its V shape)",
                    "loop": "a positive int"}[style]
            raise UsageError(f"Pipeline(stages_per_rank={V!r}) with schedule {self.schedule!r}: expected {want}")
        m = self.microbatches
        if m is not None and not positive(m):
            raise UsageError(f"Pipeline(microbatches={m!r}): expected a positive int, or None for one per stage")
        refused = schedule_refusal(self.schedule, self.stages, V, self.n_microbatches)
        if refused:
            raise UsageError(f"Pipeline(schedule={self.schedule!r}, stages={self.stages}, microbatches={m}): "
                             f"{refused}; pass more micro-batches or another schedule ('gpipe' takes any number)")
        if self.split_points is not None:
            points, n = tuple(self.split_points), self.total
            if len(points) != n - 1 or not all(isinstance(p, str) for p in points):
                raise UsageError(f"Pipeline(split_points={self.split_points!r}): expected {n - 1} module paths (where "
                                 f"stages 1 .. {n - 1} of {n} begin), e.g. ['model.layers.16']")
            object.__setattr__(self, "split_points", points)

    @property
    def n_microbatches(self) -> int:
        return self.microbatches or (self.total if self.schedule == "dualpipev" else self.stages)

    @property
    def total(self) -> int:
        """Stages the model is cut into: stages * stages_per_rank."""
        return self.stages * self.stages_per_rank

    @property
    def style(self) -> str:
        """How stages sit on the pipeline ranks: 'loop' (p, p+S, ...) or 'v' (p, 2S-1-p)."""
        return "v" if SCHEDULES[self.schedule][1] == "v" else "loop"


def blocks(model: nn.Module) -> list:
    """The module paths of the model's repeated blocks (`model.layers.0`, ...; `passes.nodes.repeated_blocks`)."""
    return repeated_blocks(name for name, _ in model.named_modules())


def split_points(model: nn.Module, given, n: int) -> tuple:
    """The module paths where stages 1 .. n-1 begin: `given` (checked), or the repeated blocks in n runs
    of equal length."""
    runs = blocks(model)
    if given is not None:
        modules = dict(model.named_modules())
        bad = [p for p in given if p not in modules or p == ""]
        if bad:
            raise UsageError(f"Pipeline(split_points=...): {bad} {'is not a' if len(bad) == 1 else 'are not'} module "
                             f"path{'s' if len(bad) > 1 else ''} of this model; candidates (its repeated blocks): "
                             f"{runs or sorted(modules)[:20]}")
        return tuple(given)
    if len(runs) < n:
        raise UsageError(f"a pipeline of {n} stages without split_points: the model has {len(runs)} repeated blocks "
                         f"({runs[:4]}...), fewer than the stages; pass split_points=[module paths]")
    return tuple(runs[round(k * len(runs) / n)] for k in range(1, n))


def stage_ids(p: int, S: int, V: int, style: str) -> list:
    """The stages pipeline rank p of S holds, V each: 'loop' p, p+S, ...; 'v' p and 2S-1-p."""
    return [p, 2 * S - 1 - p] if style == "v" else [p + k * S for k in range(V)]


def chunks(args: tuple, kwargs: dict, m: int) -> list:
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


def cut(model: nn.Module, points: tuple, args: tuple, kwargs: dict, n: int):
    """torch's `pipeline()` of the model split at `points`, and each stage module's (inputs, outputs) on
    this micro-batch (detached; `requires_grad` where the value depends on a trained parameter), with
    the model's output on it."""
    return shared("cut", model, (tuple(points), n, signature(args, kwargs, model.training)),
                  lambda: _cut(model, points, args, kwargs, n), copied=False)  # a stage module: `own` it


def _cut(model: nn.Module, points: tuple, args: tuple, kwargs: dict, n: int):
    # pipeline() replaces each split module's forward in place and leaves it so (torch 2.13): a second cut
    # would then recurse, and the user's model would keep the wrapper; both restored after it
    mods = [model.get_submodule(p) for p in points]
    saved = [{k: m.__dict__[k] for k in ("forward", "_orig_forward") if k in m.__dict__} for m in mods]
    try:  # the cut's nodes are never named in a message (each stage is captured again, with its lines)
        with no_stack_traces():
            pipe = pipeline(model, mb_args=args, mb_kwargs=kwargs, split_spec={p: SplitPoint.BEGINNING for p in points})
    except Exception as e:  # torch.export could not trace the model whole
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
        raise CaptureError(f"pipeline=: torch.distributed.pipelining could not split the model at {list(points)} "
                           f"({type(e).__name__}: {first})") from e
    finally:
        for m, own in zip(mods, saved):
            for k in ("forward", "_orig_forward"):
                m.__dict__.pop(k, None)
            m.__dict__.update(own)
    if pipe.num_stages != n:
        raise UsageError(f"pipeline=: splitting at {list(points)} gave {pipe.num_stages} stages, not {n}; pass "
                         f"split_points in the order the model runs them")
    seen: dict = {}
    subs = [mod for name, mod in pipe.split_gm.named_children() if name.startswith("submod_")]
    def keep(i, a, o):  # detached, each keeping whether it needs a gradient (what a stage sends back)
        seen[i] = pytree.tree_map_only(torch.Tensor, lambda t: t.detach().requires_grad_(t.requires_grad), (a, o))

    hooks = [mod.register_forward_hook(lambda _m, a, o, i=i: keep(i, a, o)) for i, mod in enumerate(subs)]
    # fake parameters (`autopar.dry_run`): the run inside their mode, so that what it builds from the inputs
    # alone (an attention mask of batch x seq x seq) is fake too, not allocated
    fake = detect_fake_mode(list(model.parameters()))
    try:
        with torch.enable_grad(), fake if fake is not None else contextlib.nullcontext():
            reference = pytree.tree_map_only(torch.Tensor, torch.Tensor.detach, pipe(*args, **kwargs))
    finally:
        for h in hooks:
            h.remove()
    return pipe, seen, reference


def crossings(pipe) -> tuple:
    """(needs, crossing) of a cut model: needs[j], the values stage j reads, in its argument order;
    crossing[j], the values that cross from stage j to j+1 (made at or before j, read after it), in a
    fixed order. A value is (stage that made it, output index) or ("input", name)."""
    calls = [c for c in pipe.split_gm.graph.nodes if c.op == "call_module" and c.target.startswith("submod_")]
    index = {c: j for j, c in enumerate(calls)}

    def value(a):
        if a.op == "placeholder":
            return ("input", a.target)
        if a.op == "call_module":
            return (index[a], 0)
        return (index[a.args[0]], a.args[1])  # getitem of a stage's outputs

    needs = [[value(a) for a in c.args] for c in calls]
    crossing = []
    for j in range(len(calls) - 1):
        later = [v for need in needs[j + 1:] for v in need if v[0] != "input" and v[0] <= j]
        crossing.append(list(dict.fromkeys(later)))
    return needs, crossing


def rank_of(i: int, S: int, style: str) -> int:
    """The pipeline rank (of S) holding stage i: 'loop' i mod S; 'v' i, or 2S-1-i on the way back."""
    return i % S if style == "loop" else (i if i < S else 2 * S - 1 - i)


def named(model: nn.Module, args: tuple, kwargs: dict) -> dict:
    """A call's inputs by name: positional ones named as `model.forward` names them, its use_cache off."""
    names = list(inspect.signature(model.forward).parameters)
    if len(args) > len(names):
        raise UsageError(f"pipeline: {len(args)} positional inputs, but the model's forward takes {names}")
    both = sorted(set(names[:len(args)]) & set(kwargs))
    if both:
        raise UsageError(f"pipeline: {both} given both by position and by name")
    return {**cache_off_kwargs(model), **dict(zip(names, args)), **kwargs}


def tied_names(model: nn.Module) -> dict:
    """Each name of a tensor the model holds under several names (an LM head tied to the token
    embedding) -> its first name."""
    first: dict = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        first.setdefault(id(p), []).append(name)
    return {name: names[0] for names in first.values() if len(names) > 1 for name in names}
