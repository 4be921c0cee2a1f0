"""`autopar.dry_run`: the program each rank of a job would run, built and stepped in this one process
under PyTorch's fake process group, with every collective it issues recorded and checked across ranks.

A collective that one rank issues in another order, with another shape or another root than its
group's other members hangs NCCL (or corrupts data) where gloo may forgive; a plan's byte count is
only as good as the program it describes. The dry run looks at the real program without the
hardware: for each simulated rank it starts `init_process_group("fake", rank=r, world_size=p)` (its
collectives return at once, values meaningless, shapes real), runs `parallelize` with the options
given, then one training step (forward, backward of the model's loss, an AdamW step), and records
every call a process group receives: the op, the group's global ranks, the tensors' shapes and
dtype, the root or peer, and autopar's line that issued it.

    report = autopar.dry_run(model, grid=(8, 8), example_kwargs=batch)   # checked: DryRunError names
    print(report)                 # per rank: calls, bytes counted and planned, memory held

By default (`ranks="cover"`) it simulates a set of ranks that covers every index of every axis at
least once, in as few ranks as the longest axis: the k-th rank holds index k mod n of each axis of n
(8 ranks of an 8x8 grid, its diagonal; 8 of 8 stages x 4 replicas x 4x4). Such a set compares groups
only where two of its ranks share one (a pipeline chain, the world); `ranks="groups"` adds, on the first
and the last stage, a cross through position (0, 0, 0) (one replica group, one row and one column
simulated whole) and position (0, 0, 0) on every stage (one pipeline chain whole); `ranks="all"`, or a
list. Rank 0 is always simulated, first: what it decides and sends as an object (`strategy="auto"`'s
choice) is handed to the ranks simulated after it, which the fake group would leave without it.
`check()` compares, for every group with two or more simulated members, their sequences of (op,
shapes, dtype, root) and every simulated pair's point-to-point traffic, and looks for an order of calls
across groups that would wait for ever (rank a before group G's call issues group H's, rank b the other
way round); object exchanges (parallelize's handshakes, whose pickles the fake group does not move) are
compared by op and group alone. Each rank's bytes of the step are set beside its plan at its grid
position (`autopar.planning.explain.graph_rows` of its own program), and what it holds beside what the
estimate says (`held`: parameters, gradients, optimizer state, and the most bytes saved for backward
alive at once).

A model built on the meta device (`autopar.meta_init()`; transformers' buffers restored by
`autopar.checkpoint.restore_buffers`) runs on fake tensors by default (`fake=True`): parameters,
activations and gradients hold no memory and nothing is computed, while autopar's library ops run
their eager bodies, so every collective is issued, counted and recorded as on real tensors. The ranks
share one capture of the model (and one pipeline cut): the first rank's is kept and each later one
gets a copy (`autopar.program.memo`), unless the capture asked for the rank (a model that branches on
it), which each rank then captures itself. On fake tensors the ranks run side by side in `workers`
forked processes (default: one per CPU; `autopar.program.workers`), which relay to one another what
a rank's setup sends later ranks. Measured here (2 cores, two workers), a Llama-3-70B shape at
sequence 1,024: 64 ranks (8x8, the 8 default ranks) 62 s; 512 ranks (8 stages x 4 sharded replicas x
4x4) 65 s; 4,096 ranks (8 x 8 x 8x8) 68 s; 0.54-0.59x of one worker's time, 0.5-0.75 GB peak RSS per
process (docs/benchmarks.md). With `fake=False` each rank computes its
share for real (1/p of the model, uninitialised where it was on meta): a mixture of experts needs that,
its routing reading values. Pipeline stages (`pipeline=`) run on fake tensors too
(torch's cut runs the model on them; a micro-batch's share of the loss, counted from its targets' values
on the ranks, is equal under fake tensors); what a stage sends the next as an object (its layouts, the
same at every grid position) is relayed from the simulated rank of the stage before. In the looped
and V schedules (several stages per rank) a rank's later stage waits on what a later rank sends it:
each simulated rank then runs in a forked process of its own (Linux, fake tensors), waiting for what it
is sent whatever the order. Which stages read a weight tied across stages is exchanged with an all-gather, which is not
relayed: each rank sees only its own stage's reads, so the tied gradient's all-reduce is missing from
the record.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from autopar.errors import AutoparError, UsageError
from autopar.parallel.recorder import Collective, EagerOps, Recorder, model_lines, train_step
from autopar.program.memo import shared_captures
from autopar.program.spec import parse_spec
from autopar.program.workers import can_fork, side_by_side
from autopar.planning.progress import steps as progress
from passes.options import DEFAULTS
from passes.compat import data_dependent_errors, fake_tensor_mode, fake_world, pytree

__all__ = ["Collective", "DryRun", "DryRunError", "RankRun", "covering_ranks", "dry_run"]

_DATA_DEPENDENT = data_dependent_errors()


class DryRunError(AutoparError, RuntimeError):
    """Two simulated ranks of one process group issue different collectives (the bug that hangs NCCL)."""


@dataclass
class RankRun:
    """One simulated rank: `at` its (replica, row, column); `setup` the collectives of `parallelize`,
    `step` those of the training step; `counted` the bytes its grid's CommLog counted in the step (by
    kind: 'grid', 'replicas', with context_parallel 'context'), `planned` the grid bytes its program's plan
    prices at its position; `counted["grid_calls"]` the grid's collective launches; `held` the bytes it holds
    after the step (parameters, gradients, optimizer state) and the most the step kept saved for backward at once
    (`saved`, see `_step`); `tags` the step's bytes per CommLog tag (a collective's node, 'pp:send',
    'fsdp:all-gather', ...)."""

    rank: int
    at: tuple
    setup: list = field(default_factory=list)
    step: list = field(default_factory=list)
    counted: dict = field(default_factory=dict)
    planned: int = 0
    held: dict = field(default_factory=dict)
    tags: dict = field(default_factory=dict)
    lines: dict = field(default_factory=dict)  # a step collective's `node` -> the model's source line

    @property
    def agrees(self) -> bool:
        """Whether the grid bytes the step moved equal the plan's at this rank's position (and a pipeline
        rank's sends, `p2p_traffic()`'s)."""
        return self.counted.get("grid", 0) == self.planned and self.counted.get("pp", 0) == self.counted.get(
            "pp_planned", 0)


@dataclass
class DryRun:
    """What `dry_run` found: the world size, the grid and a RankRun per simulated rank."""

    world: int
    grid: tuple
    ranks: dict
    stages: int = 1  # pipeline stages (ranks world / stages per stage)

    def members(self, phase: str = "step") -> dict:
        """{group (global ranks): {simulated rank: [Collective, ...] in issue order}}, sends and receives
        left out."""
        out: dict = {}
        for rank, run in self.ranks.items():
            for c in getattr(run, phase):
                if c.op not in ("send", "recv"):  # point to point: checked pair by pair (`check`)
                    out.setdefault(c.group, {}).setdefault(rank, []).append(c)
        return out

    def check(self) -> None:
        """Raise DryRunError at the first disagreement: two simulated members of a group whose sequences
        differ (op, shapes, dtype, root; object exchanges by op), or a send without its receive."""
        for phase, exact in (("setup", False), ("step", True)):
            for group, seqs in sorted(self.members(phase).items()):
                first = min(seqs)
                for rank in sorted(seqs):
                    _same(group, phase, exact, first, seqs[first], rank, seqs[rank], self.ranks)
        self._pairs()
        self._order()

    def _order(self) -> None:
        """A collective completes once every member has issued it, and each rank issues its own in order:
        so rank a issuing the k-th call of group G before the j-th of group H, while rank b issues that
        one of H before that one of G, waits for ever (NCCL hangs; gloo too). Each call is the node
        (group, k); each rank's order adds edges between its consecutive calls; a cycle is the hang."""
        after: dict = {}  # (group, k) -> {(group', k') issued next by some rank: that rank}
        for rank, run in sorted(self.ranks.items()):
            count: dict = {}
            prev = None
            for c in run.step:
                if c.op in ("send", "recv"):  # point to point: a pair, not a group call
                    continue
                node = (c.group, count.get(c.group, 0))
                count[c.group] = node[1] + 1
                if prev is not None:
                    after.setdefault(prev, {}).setdefault(node, rank)
                prev = node
        cycle = _cycle(after)
        if cycle:
            steps = "; ".join(f"call {k} of group {list(g)} before call {k2} of group {list(g2)} "
                              f"(rank {after[(g, k)][(g2, k2)]})"
                              for (g, k), (g2, k2) in zip(cycle, cycle[1:] + cycle[:1]))
            raise DryRunError(f"dry run: the ranks issue collectives of different groups in orders that wait on one "
                              f"another for ever: {steps}. Issue them in one order on every rank")

    def _pairs(self) -> None:
        sent: dict = {}
        got: dict = {}
        for rank, run in self.ranks.items():
            for c in run.step:
                if c.op == "send":
                    sent.setdefault((rank, c.peer), []).append(c.shapes)
                elif c.op == "recv":
                    got.setdefault((c.peer, rank), []).append(c.shapes)
        for (a, b) in sorted(set(sent) | set(got)):
            if a in self.ranks and b in self.ranks and sent.get((a, b), []) != got.get((a, b), []):
                raise DryRunError(f"dry run: rank {a} sends {sent.get((a, b), [])} to rank {b}, which receives "
                                  f"{got.get((a, b), [])} from it; each send needs its receive, in order and shape")

    def __str__(self) -> str:
        piped = f"{self.stages} stages x " if self.stages > 1 else ""
        lines = [f"dry run of {len(self.ranks)} of {self.world} ranks, {piped}grid {'x'.join(map(str, self.grid))} "
                 f"(position: {'stage, ' if piped else ''}replica, row, column)",
                 "rank  position        calls  grid bytes  planned     replica bytes  held params/grads/optim/saved"]
        for rank, r in sorted(self.ranks.items()):
            held = "/".join(_mib(r.held.get(k, 0)) for k in ("params", "grads", "optimizer", "saved"))
            lines.append(f"{rank:>4}  {str(r.at):<14} {len(r.step):>6}  {r.counted.get('grid', 0):>10,}  "
                         f"{r.planned:>10,}{'' if r.agrees else ' (!)'}  {r.counted.get('replicas', 0):>13,}  {held}")
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {"world": self.world, "grid": list(self.grid), "stages": self.stages,
                "ranks": {str(k): {"at": list(r.at), "calls": len(r.step), "bytes": r.counted, "planned": r.planned,
                                   "agrees": r.agrees, "held": r.held,
                                   "collectives": [[c.op, list(c.group), [list(s) for s in c.shapes], c.dtype, c.peer]
                                                   for c in r.step]}
                          for k, r in sorted(self.ranks.items())}}


def _cycle(after: dict) -> list:
    """A cycle of the graph `after` (node -> {successor: ...}) as a list of nodes, or [] (iterative DFS)."""
    state: dict = {}  # node -> 1 on the path, 2 done
    for root in after:
        if state.get(root):
            continue
        path, stack = [], [(root, iter(after.get(root, ())))]
        state[root] = 1
        path.append(root)
        while stack:
            node, succ = stack[-1]
            nxt = next(succ, None)
            if nxt is None:
                stack.pop()
                path.pop()
                state[node] = 2
            elif state.get(nxt) == 1:
                return path[path.index(nxt):]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append((nxt, iter(after.get(nxt, ()))))
    return []


def _same(group, phase, exact, a, seq_a, b, seq_b, runs: dict) -> None:
    def said(rank, c) -> str:  # the call, and the line of the model it was issued for where known
        line = runs[rank].lines.get(c.node) if c is not None else None
        return f"{c or 'nothing'}" + (f", in the model at {line}" if line else "")

    for k in range(max(len(seq_a), len(seq_b))):
        x = seq_a[k] if k < len(seq_a) else None
        y = seq_b[k] if k < len(seq_b) else None
        if x is None or y is None or x.key(exact) != y.key(exact):
            raise DryRunError(
                f"dry run: ranks {a} and {b} of group {list(group)} issue different collectives at position {k} "
                f"of the {phase}: rank {a} {said(a, x)}; rank {b} {said(b, y)}. On NCCL this hangs or "
                f"mixes data; a branch on the rank, or on data that differs between ranks, usually causes it")


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f}M"


def covering_ranks(grid: tuple, stages: int = 1, cube: bool = False, groups: bool = False) -> list:
    """The ranks to simulate by default. Positions are (stage, replica, row, column), or for a cube (whose
    ranks sit on a (q, q*q) grid, `cube`) (stage, 0, r, c*q + l), numbered row-major.

    `groups=False`: every index of every axis at least once, in as few ranks as the longest axis: the k-th
    holds index k mod n of each axis of n (an 8x8 grid's diagonal; 8 stages over 4x4x4: stage k at
    position (k mod 4, k mod 4, k mod 4)). Few ranks share a group so: groups are compared only where two
    members are simulated.
    `groups=True`: on the first and the last stage, a cross through position (0, 0, 0) (every index of
    each axis, the others at 0: one replica group, one row and one column simulated whole); on every stage
    position (0, 0, 0) (one pipeline chain whole: each send checked against its receive)."""
    shape = (1, grid[0], grid[0] ** 2) if cube else ((1, *grid) if len(grid) == 2 else tuple(grid))
    d, R, C = shape

    def rank(s: int, k: int, r: int, c: int) -> int:
        return ((s * d + k) * R + r) * C + c

    if not groups:
        return sorted({rank(i % stages, i % d, i % R, i % C) for i in range(max(stages, d, R, C))})
    cross = {(k, 0, 0) for k in range(d)} | {(0, r, 0) for r in range(R)} | {(0, 0, c) for c in range(C)}
    return sorted({rank(s, *at) for s in {0, stages - 1} for at in cross} | {rank(s, 0, 0, 0) for s in range(stages)})


def dry_run(model, grid=(2, 2), example_inputs=(), example_kwargs=None, *, ranks=None, check: bool = True,
            fake: bool | None = None, workers: int | None = None, **options) -> DryRun:
    """Simulate `ranks` ('cover', the default, or 'groups': `covering_ranks`; 'all'; or a list) of
    `parallelize(model, grid, example_inputs, example_kwargs, **options)` in this process (see the
    module docstring) and return what they did; with `check`, raise DryRunError where two simulated
    ranks of a group disagree. `fake`: run the step on fake tensors (shapes, no memory, no compute; the
    default for a model on the meta device), else on real ones (a mixture of experts needs them: its
    routing reads values). `workers`: processes that simulate the ranks side by side on fake tensors
    (None: one per CPU this process may use; `autopar.program.workers`); real tensors run in this one.
    Call it in a process without a process group of its own (it starts and ends a fake one per rank)."""
    if dist.is_available() and dist.is_initialized():
        raise UsageError("autopar.dry_run starts a fake process group per simulated rank: call it in a process "
                         "that has not called torch.distributed.init_process_group (or destroy that group first)")
    spec = parse_spec(grid, options.get("strategy", DEFAULTS.strategy), options.get("pipeline"),
                      options.get("data_parallel", DEFAULTS.data_parallel), "autopar.dry_run")
    if spec.grid is None:
        raise UsageError(f"autopar.dry_run: grid={grid!r}: a device count is arranged by a search on rank 0; pass "
                         f"the arrangement, (R, C), (dp, R, C) or a cube (q, q, q) (autopar.choose_grid shows it)")
    stages = spec.stages
    looped = spec.pipeline is not None and spec.pipeline.stages_per_rank > 1
    cp = options.get("context_parallel", 1)  # cp copies of the (R, C) grid, side by side as replicas are
    grid, world, cube = spec.grid, spec.world * cp, spec.cube
    if ranks is None or ranks in ("cover", "groups"):  # with cp: dp * cp replicas of the (R, C) grid
        shape = (spec.dp * cp, *spec.mesh) if cp > 1 else grid
        chosen = covering_ranks(shape, stages, cube, groups=ranks == "groups")
        if stages > 1 and not cube and options.get("strategy", DEFAULTS.strategy) == "auto":
            # a stage's first rank searches its strategy and sends it to its replicas' first ranks, which send it
            # on within their grids (`autopar.program.build`): those ranks too, simulated before the others
            per, size = world // stages, grid[-2] * grid[-1]
            chosen = sorted({*chosen, *(r - r % per for r in chosen), *(r - r % size for r in chosen)})
    else:
        chosen = list(range(world)) if ranks == "all" else list(ranks) if not isinstance(ranks, str) else []
    bad = [r for r in chosen if not (isinstance(r, int) and not isinstance(r, bool) and 0 <= r < world)]
    if bad or not chosen:
        raise UsageError(f"autopar.dry_run: ranks={ranks!r}: expected 'cover' (the default), 'groups', 'all' or "
                         f"ranks in [0, {world}) of {stages} stage(s) x grid {grid}")
    chosen = sorted({0, *chosen})  # rank 0 first: what it decides and sends, the others receive
    if fake is None:
        fake = any(p.is_meta for p in model.parameters())
    mode = fake_tensor_mode(allow_real=True) if fake else None  # one for all: their shared captures hold its tensors
    model = copy.deepcopy(model)  # one copy for all the ranks (parallelize copies weights, it changes no model)
    if mode is not None:
        with mode:
            _fake_parameters(model)
    if workers is None:
        workers = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
    if not (isinstance(workers, int) and not isinstance(workers, bool) and workers >= 1):
        raise UsageError(f"autopar.dry_run: workers={workers!r}: expected a positive int (processes simulating "
                         f"ranks side by side) or None (one per CPU this process may use)")
    if not fake:  # real tensors (a mixture of experts) pass real objects in their steps: one process
        workers = 1

    stand_in = None
    if looped:  # a rank's later stage is built from what a later rank sends it: every rank a process of its own
        if not (fake and can_fork()):
            raise UsageError("autopar.dry_run: pipelines with several stages per rank (the looped and V schedules) "
                             "are simulated with a forked process per rank on fake tensors (Linux; fake=True): a "
                             "rank's later stage waits on what a later rank sends it")
        per = world // stages
        workers = len(chosen)

        def stand_in(source):  # the simulated ranks of the source's place in the pipeline chain
            return [r for r in chosen if r // per == source // per]

    def simulate(rank, relay):
        return _simulate(model, grid, rank, world, example_inputs, example_kwargs or {}, options, relay, mode)

    with progress("dry run", len(chosen)) as bar, shared_captures(mode):
        runs = side_by_side(chosen, workers, simulate, lambda rank: bar.update(), stand_in)
    report = DryRun(world, grid, runs, stages)
    if check:
        report.check()
    return report


def _simulate(model, grid, rank, world, args, kwargs, options, sent, mode) -> RankRun:
    from autopar.parallel.api import parallelize
    from autopar.parallel.sharded import memory_per_rank
    from autopar.planning.explain import graph_rows

    with fake_world(rank, world):  # DTensor's caches emptied: they would hand this rank the last one's meshes
        stages = world // math.prod(grid) // options.get("context_parallel", 1)
        rec = Recorder(rank, sent, world // stages if stages > 1 else 0)
        try:
            with rec, warnings.catch_warnings():
                warnings.simplefilter("ignore")  # one process's warnings, repeated by every simulated rank
                pm = parallelize(model, grid=grid, example_inputs=args, example_kwargs=kwargs, **options)
                setup = rec.take()
                sent.setup_done(rank)
                pm.materialized = True  # a model built on the meta device: its blocks are allocated, not loaded
                pm.grid.log.reset()
                with mode or contextlib.nullcontext(), EagerOps() if mode is not None else contextlib.nullcontext():
                    opt, saved = train_step(pm, *_inputs(mode, args, kwargs))
                step = rec.take()
            log, g = pm.grid.log, pm.grid
            replicas, p2p = log.total("dp:") + log.total("fsdp:"), log.total("pp:")
            context = log.total("context ")  # context_parallel's (passes.cost.context prices them; explain does not)
            piped = hasattr(pm, "p2p_traffic")
            m = pm.pipeline.n_microbatches if piped else 1  # a stage's program runs once per micro-batch
            planned = m * sum(r.fwd_bytes + r.bwd_bytes + r.recompute_bytes for s in getattr(pm, "stage_modules", [pm])
                              for r in graph_rows(s.program.inspected, g.shape, at=(g.r, g.c)))
            at = (g.stage, g.dp_index, g.r, g.c) if piped else (g.dp_index, g.r, g.c)
            counted = {"grid": log.total() - replicas - p2p - context, "replicas": replicas,
                       "grid_calls": log.calls() - log.calls("dp:") - log.calls("fsdp:") - log.calls("pp:")
                       - log.calls("context ")}
            if context:
                counted["context"] = context
            if piped:
                counted.update(pp=p2p, pp_planned=sum(b for _, b in pm.p2p_traffic().values()))
            tags: dict = {}
            for (tag, _), n in log.bytes.items():
                tags[tag] = tags.get(tag, 0) + n
            return RankRun(rank, at, setup, step, counted, planned, {**memory_per_rank(pm, opt), "saved": saved}, tags,
                           model_lines(pm, step))
        except _DATA_DEPENDENT as e:
            raise UsageError(f"autopar.dry_run: this model's step reads values that fake tensors do not have "
                             f"({type(e).__name__}: {str(e).splitlines()[0][:200]}); a mixture of experts routes by "
                             f"them. Pass fake=False to compute each rank's share with real tensors") from e
        except Exception as e:  # one that an object never received explains: named
            if not rec.missed:
                raise
            raise UsageError(f"autopar.dry_run: rank {rank} receives an object (a decision, a stage's layouts) from "
                             f"rank {rec.missed[0][1]}, which is not simulated (before it; in a looped schedule, at "
                             f"all), and fails without it "
                             f"({type(e).__name__}: {str(e).splitlines()[0][:160]}); add rank {rec.missed[0][1]} to "
                             f"ranks=") from e


def _fake_parameters(model) -> None:
    """Each parameter of `model` replaced by an uninitialised one of its shape and dtype, on the CPU
    (inside a FakeTensorMode: a fake tensor, which holds no memory); a parameter held under several
    names (a tied LM head) by one new parameter under all of them."""
    new: dict = {}
    for name, p in list(model.named_parameters(remove_duplicate=False)):
        if id(p) not in new:
            new[id(p)] = torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype), requires_grad=p.requires_grad)
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent), leaf, new[id(p)])


def _inputs(mode, args: tuple, kwargs: dict) -> tuple:
    if mode is None:
        return args, kwargs
    return pytree.tree_map_only(torch.Tensor, mode.from_tensor, (args, kwargs))
