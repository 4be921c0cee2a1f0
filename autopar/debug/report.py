"""`autopar.report`: record a few training steps of a parallel model with `torch.profiler` and set the
plan beside the run, node by node.

    with autopar.report(pmodel, steps=3, out="autopar-report") as rep:
        for batch in batches[:3]:
            loss = pmodel(**batch).loss
            loss.backward(); opt.step(); opt.zero_grad()
            rep.step()
    print(rep)        # the table; the files are in autopar-report/

Each eager program call runs node by node inside a profiler range per node (`ParallelModule.observing`),
each collective inside a range of its own (`passes.ops.comm.profiled`); backward time is given to the node
whose forward ops carry the backward ops' sequence numbers (what `torch.profiler` links them by). Per node:
the estimate (the cost model's FLOP rate and alpha-beta links, each node priced on its own: compute and
its collectives added, SUMMA's overlap not applied) and the measured forward, backward and collective
time and bytes (`Grid.log`), per step. Written by rank 0: `report.json`, `trace.json` (Chrome trace
format, opens in ui.perfetto.dev: a process per rank with forward, backward and collective lanes, and
one for the estimate's schedule of rank 0's program) and `report.png` (estimated against measured per
node, with matplotlib). Memory: on CUDA the allocator's peak in the window, on the CPU the process's peak
resident set (since it started). The same ops run in the same order: results are bit-identical.
"""

from __future__ import annotations

import json
import math
import os
import resource
import time
import warnings
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function

from autopar.errors import UsageError
from autopar.planning.explain import graph_rows
from passes.cost.model import CostModel
from passes.cost.planned import nodes_needing_grad
from passes.kernels.spec import Site, flops
from passes.errors import ShardingError
from passes.layout import Layout, local_shape
from passes.meta import KERNEL, LAYOUT
from passes.nodes import module_path
from passes.ops import comm

__all__ = ["StepReport", "report"]

_NODE, _COMM, _STEP = "autopar::node ", "autopar::comm ", "autopar::step "
_BACKWARD = "autograd::engine::evaluate_function: "


def report(pmodel, steps: int = 1, out: str | None = "autopar-report") -> "StepReport":
    """A context manager around `steps` training steps of `pmodel` (a ParallelModule or PipelineModule);
    call `rep.step()` after each. On leaving, every rank's measurements are gathered and rank 0 writes
    `out`/report.json, trace.json and report.png (out=None: nothing written). Call on every rank."""
    return StepReport(pmodel, steps, out)


class _Timed:
    """The observer that runs a program node by node, each inside a profiler range named after it."""

    def __init__(self):
        self.graphs: dict = {}  # id(gm) -> gm of every program run

    def __call__(self, gm, args):
        self.graphs[id(gm)] = gm

        class Run(torch.fx.Interpreter):
            def run_node(self, n):
                if n.op in ("placeholder", "output", "get_attr"):
                    return super().run_node(n)
                with record_function(_NODE + n.name):
                    return super().run_node(n)

        return Run(gm).run(*args)


class StepReport:
    """What `report` recorded; `rows` (rank 0's nodes, per step), `steps_s` (each rank's step times),
    `memory` (each rank's), `files` (what rank 0 wrote)."""

    def __init__(self, pmodel, steps: int, out: str | None):
        if steps < 1:
            raise UsageError(f"report: steps={steps}; expected at least 1 training step to record")
        if not hasattr(pmodel, "grid"):
            raise UsageError(f"report: expected a model autopar.parallelize returned, got {type(pmodel).__name__}")
        self.pmodel, self.steps, self.out = pmodel, steps, out
        self.stages = pmodel.stage_modules if hasattr(pmodel, "stage_modules") else [pmodel]
        self.done, self.rows, self.steps_s, self.memory, self.files, self.notes = 0, [], [], [], [], []
        self._timed = _Timed()

    def __enter__(self) -> "StepReport":
        grid = self.pmodel.grid
        self._log = {k: dict(s.grid.log.bytes) for k, s in enumerate(self.stages)}
        if torch.cuda.is_available() and grid.device_type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if grid.device_type == "cuda" else [])
        dist.barrier()  # the ranks' lanes start together
        self._stack = [s.observing(self._timed) for s in self.stages] + [comm.profiled()]
        for cm in self._stack:
            cm.__enter__()
        self._prof = profile(activities=activities, profile_memory=True)
        self._prof.__enter__()
        self._step_range = record_function(_STEP + "0")
        self._step_range.__enter__()
        self._marks = [time.perf_counter()]
        return self

    def step(self) -> None:
        """Mark the end of one training step."""
        self._step_range.__exit__(None, None, None)
        self.done += 1
        self._marks.append(time.perf_counter())
        self._step_range = record_function(_STEP + str(self.done))
        self._step_range.__enter__()

    def __exit__(self, kind, value, tb) -> None:
        self._step_range.__exit__(None, None, None)
        self._prof.__exit__(None, None, None)
        for cm in reversed(self._stack):
            cm.__exit__(None, None, None)
        if kind is not None:  # the user's step failed: nothing to report, the error is what matters
            return
        if self.done == 0:
            raise UsageError(f"report: no step was marked; call rep.step() after each of the {self.steps} "
                             f"training steps inside the `with` block")
        if self.done != self.steps:
            self.notes.append(f"{self.done} step(s) were marked, {self.steps} asked for: the figures are per marked "
                              f"step")
        self._finish()

    # ------------------------------------------------------------------ measuring
    def _measured(self, events) -> tuple:
        """(per node: [fwd us, bwd us, collective us, collective calls, bytes its forward left allocated],
        trace events of this rank)."""
        per: dict = defaultdict(lambda: [0.0, 0.0, 0.0, 0, 0])
        cuda = self.pmodel.grid.device_type == "cuda"
        owner: dict = {}  # sequence number of a forward op -> its node
        lanes = []
        rank = dist.get_rank()

        def walk(e, name, lane):
            for c in e.cpu_children:
                if lane == 1 and c.sequence_nr >= 0:
                    owner.setdefault(c.sequence_nr, name)
                if c.name.startswith(_COMM):
                    dur = c.time_range.elapsed_us()
                    per[name][2] += dur
                    per[name][3] += 1
                    lanes.append(_event(c.name[len(_COMM):], c, rank, 3))
                walk(c, name, lane)

        for e in events:
            if e.name.startswith(_NODE):
                name = e.name[len(_NODE):]
                per[name][0] += e.time_range.elapsed_us()
                per[name][4] += e.device_memory_usage if cuda else e.cpu_memory_usage
                lanes.append(_event(name, e, rank, 1))
                walk(e, name, 1)
            elif e.name.startswith(_STEP):
                lanes.append(_event("step " + e.name[len(_STEP):], e, rank, 0))
        for e in events:
            if e.name.startswith(_BACKWARD) and e.sequence_nr in owner:
                name = owner[e.sequence_nr]
                per[name][1] += e.time_range.elapsed_us()
                lanes.append(_event(name + " (backward)", e, rank, 2))
                walk(e, name, 2)
        return per, lanes

    def _finish(self) -> None:
        per, lanes = self._measured(self._prof.events())
        n = self.done
        rows = []
        for k, stage in enumerate(self.stages):
            grid, gm = stage.grid, stage.program.gm
            got = {t: v - self._log[k].get(t, 0) for t, v in grid.log.bytes.items()}
            est = _estimates(gm, grid, CostModel.resolve(stage.options.cost_model))
            grads = nodes_needing_grad(gm)
            planned = {r.node: r.fwd_bytes + r.bwd_bytes for r in graph_rows(stage.program.inspected, grid.shape,
                                                                            (grid.r, grid.c))}
            for node in gm.graph.nodes:
                if node.name not in per and node.name not in est:
                    continue
                fwd, bwd, cus, calls, held = per.get(node.name, (0.0, 0.0, 0.0, 0, 0))
                e = est.get(node.name, (0.0, 0.0, 0))
                spec = node.meta.get(KERNEL)
                mine = {getattr(spec, "tag", "") or node.name}  # the CommLog tag its collectives count under
                moved = sum(v for (t, _), v in got.items() if t in mine)
                rows.append({"stage": k, "node": node.name, "op": _op(node), "module": module_path(node),
                             "estimated_fwd_s": e[0], "estimated_bwd_s": e[1],
                             "estimated_bytes": planned.get(node.name, e[2]),
                             "measured_fwd_s": fwd / 1e6 / n, "measured_bwd_s": bwd / 1e6 / n,
                             "measured_comm_s": cus / 1e6 / n, "collectives": calls // n, "measured_bytes": moved // n,
                             "estimated_saved_bytes": _saved(node, grid, grads),
                             "measured_allocated_bytes": held // n})
        if not self._timed.graphs:
            self.notes.append("no program ran eagerly here (compile=True or torch.compile(pmodel)): times per node and "
                              "the collective lane are not measured, bytes and step times are")
        steps_s = [b - a for a, b in zip(self._marks, self._marks[1:])]
        memory = _memory(self.pmodel.grid)
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, (rows, steps_s, memory, lanes))
        self.rows = every[0][0]
        self.steps_s = [e[1] for e in every]
        self.memory = [e[2] for e in every]
        if dist.get_rank() == 0 and self.out is not None:
            self.files = _write(self.out, self, [e[3] for e in every])

    # ------------------------------------------------------------------ showing
    def __str__(self) -> str:
        head = (f"autopar report: {self.done} step(s); step time per rank (mean): "
                + ", ".join(f"{sum(s) / len(s) * 1e3:.1f} ms" for s in self.steps_s if s))
        lines = [head, f"{'node':<28} {'op':<22} {'est. ms':>8} {'meas. ms':>8} {'comm ms':>8} {'calls':>5} "
                       f"{'est. bytes':>10} {'meas. bytes':>11} {'est. saved':>10} {'allocated':>10}"]
        top = sorted(self.rows, key=lambda r: -(r["measured_fwd_s"] + r["measured_bwd_s"]))[:20]
        for r in top:
            lines.append(f"{r['node'][:28]:<28} {r['op'][:22]:<22} "
                         f"{(r['estimated_fwd_s'] + r['estimated_bwd_s']) * 1e3:8.3f} "
                         f"{(r['measured_fwd_s'] + r['measured_bwd_s']) * 1e3:8.3f} {r['measured_comm_s'] * 1e3:8.3f} "
                         f"{r['collectives']:5d} {r['estimated_bytes']:10d} {r['measured_bytes']:11d} "
                         f"{r['estimated_saved_bytes']:10d} {r['measured_allocated_bytes']:10d}")
        lines.append("memory per rank: " + ", ".join(f"{m['kind']} {m['peak_bytes'] / 2**20:.0f} MiB"
                                                     for m in self.memory))
        lines += [f"note: {t}" for t in self.notes]
        if self.files:
            lines.append("written: " + ", ".join(self.files))
        return "\n".join(lines)


def _event(name: str, e, rank: int, tid: int) -> dict:
    return {"name": name, "ph": "X", "ts": e.time_range.start, "dur": e.time_range.elapsed_us(), "pid": rank,
            "tid": tid}


def _op(node) -> str:
    spec = node.meta.get(KERNEL)
    if spec is not None:
        return type(spec).__name__.removesuffix("Spec")
    return str(node.target) if node.op == "call_function" else node.op


def _estimates(gm, grid, cm: CostModel) -> dict:
    """node -> (forward s, backward s, bytes received) as the cost model prices the node alone: its FLOPs
    (a third forward where it trains: one product forward, two backward) at the model's rate, and each
    collective step of its spec as alpha + bytes/beta on its axis."""
    grads, mesh, out = nodes_needing_grad(gm), grid.shape, {}
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_module"):
            continue
        spec = node.meta.get(KERNEL) if node.op == "call_module" else None
        site = Site.inserted(node, mesh, grads)
        total = flops(site, spec)
        fwd_flops = total / 3 if node in grads else total
        t = {"fwd": fwd_flops / cm.flops, "bwd": (total - fwd_flops) / cm.flops}
        moved = 0
        if spec is not None:
            for axis, phase, nbytes in spec.steps(site, spec.values(site), exact=False):
                if mesh[axis] > 1:
                    t["fwd" if phase == "fwd" else "bwd"] += cm.collective(axis, nbytes, 1)
                    moved += int(nbytes)
        out[node.name] = (t["fwd"], t["bwd"], moved)
    return out


def _saved(node, grid, grads: set) -> int:
    """The bytes of this rank's block of the node's output where it needs a gradient (the estimate's
    activation memory: what autograd may keep for backward, an upper bound), else 0."""
    v, lay = node.meta.get("val"), node.meta.get(LAYOUT)
    if node not in grads or not isinstance(v, torch.Tensor) or not isinstance(lay, Layout):
        return 0
    try:
        return math.prod(local_shape(tuple(v.shape), lay, grid.shape, at=(grid.r, grid.c))) * v.element_size()
    except ShardingError:
        return 0


def _memory(grid) -> dict:
    if grid.device_type == "cuda" and torch.cuda.is_available():
        return {"kind": "CUDA allocator peak", "peak_bytes": int(torch.cuda.max_memory_allocated())}
    return {"kind": "CPU peak RSS", "peak_bytes": int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024}


def _write(out: str, rep: StepReport, lanes: list) -> list:
    os.makedirs(out, exist_ok=True)
    files = []
    path = os.path.join(out, "report.json")
    with open(path, "w") as f:
        json.dump({"steps": rep.done, "rows": rep.rows, "step_s": rep.steps_s, "memory": rep.memory,
                   "notes": rep.notes}, f, indent=1)
    files.append(path)
    path = os.path.join(out, "trace.json")
    with open(path, "w") as f:
        json.dump(_trace(rep, lanes), f)
    files.append(path)
    try:
        files.append(_chart(out, rep.rows))
    except ImportError:
        rep.notes.append("no chart: matplotlib is not installed (pip install autopar[plot])")
    return files


def _trace(rep: StepReport, lanes: list) -> dict:
    """Chrome trace events: per rank a process with lanes step / forward / backward / collectives, and
    one process for the estimate of rank 0's program laid out in order (forward, then backward reversed)."""
    events = []
    names = {0: "steps", 1: "forward (per node)", 2: "backward (per node)", 3: "collectives"}
    for rank, evs in enumerate(lanes):
        events.append({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}})
        events += [{"name": "thread_name", "ph": "M", "pid": rank, "tid": t, "args": {"name": n}}
                   for t, n in names.items()]
        events += evs
    est = len(lanes)
    events.append({"name": "process_name", "ph": "M", "pid": est, "args": {"name": "estimate (rank 0's program)"}})
    start = min((e["ts"] for e in lanes[0]), default=0.0)
    t = start
    for r in rep.rows:
        dur = r["estimated_fwd_s"] * 1e6
        if dur > 0:
            events.append({"name": r["node"], "ph": "X", "ts": t, "dur": dur, "pid": est, "tid": 1})
        t += dur
    for r in reversed(rep.rows):
        dur = r["estimated_bwd_s"] * 1e6
        if dur > 0:
            events.append({"name": r["node"] + " (backward)", "ph": "X", "ts": t, "dur": dur, "pid": est, "tid": 2})
        t += dur
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def _chart(out: str, rows: list) -> str:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    top = sorted(rows, key=lambda r: -(r["measured_fwd_s"] + r["measured_bwd_s"]))[:15][::-1]
    fig, ax = plt.subplots(figsize=(9, 0.35 * len(top) + 1.5))
    y = range(len(top))
    ax.barh([i + 0.2 for i in y], [(r["measured_fwd_s"] + r["measured_bwd_s"]) * 1e3 for r in top], 0.4,
            label="measured")
    ax.barh([i - 0.2 for i in y], [(r["estimated_fwd_s"] + r["estimated_bwd_s"]) * 1e3 for r in top], 0.4,
            label="estimated")
    ax.set_yticks(list(y), [f"{r['node']} ({r['op'][:24]})" for r in top], fontsize=8)
    ax.set_xlabel("ms per step, forward + backward (rank 0)")
    ax.legend()
    fig.tight_layout()
    path = os.path.join(out, "report.png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path

