"""`python -m autopar bench --pipeline`: pipeline stages against one 2D and one 1D grid on 8 gloo ranks.

The benchmark Llama (`autopar.bench.common`, 4 layers) trained with AdamW on the same global batch
(8 x 128 tokens) four ways: 2 stages of a 2x2 grid with 1F1B (4 micro-batches), 2 stages of 2x2 with
the breadth-first schedule (2 stages per rank, 4 micro-batches), a 2x4 grid (2D) and a 1x8 grid (1D),
the last two on the whole batch. Per configuration: the median step (forward, backward, optimizer;
the slowest rank's), bytes received per rank per step and collective calls (the grids' collectives
and the point-to-point sends), the parameter bytes a rank holds, the peak of the bytes autograd holds
saved for backward during a step (what a schedule keeps in flight), and, for the pipelines, the
bubble: the share of the step a rank spends outside its stages' forward and backward (measured
around torch's PipelineStage calls), next to the schedule's estimate.
Configurations alternate round by round. Eight processes share two cores here: the times measure
contention as much as the schedules.
"""

from __future__ import annotations

import copy
import functools
import json
import statistics
import time
import warnings

import torch
import torch.distributed as dist

import autopar
from autopar.bench import common
from autopar.launch import close, init_local
from passes.cost.pipeline import bubble

WORLD = 8
CONFIGS = {  # label -> parallelize keywords
    "2 stages x 2x2, 1f1b": dict(grid=(2, 2), pipeline=autopar.Pipeline(stages=2, schedule="1f1b", microbatches=4)),
    "2 stages x 2x2, looped_bfs": dict(grid=(2, 2), pipeline=autopar.Pipeline(
        stages=2, schedule="looped_bfs", microbatches=4, stages_per_rank=2)),
    "2x4 (2D)": dict(grid=(2, 4)),
    "1x8 (1D)": dict(grid=(1, 8), strategy="1d"),
}


class _Busy:
    """Seconds this rank spent inside its PipelineStages' forward and backward calls."""

    def __init__(self, stages: list):
        self.s = 0.0
        for stage in stages:
            for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
                if hasattr(stage, name):
                    setattr(stage, name, self._timed(getattr(stage, name)))

    def _timed(self, fn):
        @functools.wraps(fn)
        def run(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.s += time.perf_counter() - t0
        return run


class _Saved:
    """The peak of the bytes autograd holds saved for backward during a step (each storage once): what a
    schedule keeps in flight. torch's MemTracker refuses a module called several times in one step,
    as a pipeline stage is (once per micro-batch)."""

    def __init__(self):
        self.now = self.peak = 0
        self.live: dict = {}  # storage pointer -> [saves alive, bytes]

    def pack(self, t):
        key = t.untyped_storage().data_ptr() if t.device.type != "meta" else id(t)
        entry = self.live.setdefault(key, [0, t.untyped_storage().nbytes()])
        if entry[0] == 0:
            self.now += entry[1]
            self.peak = max(self.peak, self.now)
        entry[0] += 1
        return _Held(self, key), t

    def release(self, key) -> None:
        entry = self.live[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.now -= entry[1]
            del self.live[key]


class _Held:
    def __init__(self, saved: _Saved, key):
        self.saved, self.key = saved, key

    def __del__(self):
        self.saved.release(self.key)


def peak_saved(fn) -> int:
    saved = _Saved()
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda packed: packed[1]):
        fn()
    return saved.peak


def one_step(pm, opt, step: int) -> float:
    batch = common.batch(step)
    if hasattr(pm, "train_step"):
        loss = pm.train_step(**batch)
    else:
        loss = pm(**batch).loss
        loss.backward()
    opt.step()
    opt.zero_grad()
    return float(loss.detach())


def worker(rank, world, port, rounds, steps, configs, out):
    """Train the benchmark Llama under each of `configs` (label -> parallelize keywords) and write the
    figures of the module docstring to `out` (rank 0). `autopar.bench.cube` runs it with its own."""
    init_local(rank, world, port)
    base = common.model()
    pms, opts, res, busy = {}, {}, {}, {}
    for label, kw in configs.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pm = autopar.parallelize(copy.deepcopy(base), example_kwargs=common.batch(0), **kw)
        pms[label], opts[label] = pm, torch.optim.AdamW(pm.parameters(), lr=1e-4)
        res[label] = {"times": [], "losses": [], "busy": []}
        if "pipeline" in kw:
            busy[label] = _Busy(pm.schedule_stages)
    for label, pm in pms.items():  # one measured step each: bytes, calls, memory
        pm.grid.log.reset()
        res[label]["losses"].append(one_step(pm, opts[label], 0))
        log = pm.grid.log
        res[label].update(bytes=log.total(), calls=log.calls(), p2p_bytes=log.total("pp:"),
                          params=sum(p.to_local().numel() * p.element_size() for p in pm.parameters()))
        res[label]["peak_saved_bytes"] = peak_saved(functools.partial(one_step, pm, opts[label], 1))
    for r in range(rounds):
        for label, pm in pms.items():
            for s in range(steps):
                dist.barrier()
                before = busy[label].s if label in busy else 0.0
                t0 = time.perf_counter()
                res[label]["losses"].append(one_step(pm, opts[label], 2 + r * steps + s))
                took = time.perf_counter() - t0
                res[label]["times"].append(took)
                if label in busy:
                    res[label]["busy"].append((busy[label].s - before) / took)
    for label in pms:
        res[label]["step_s"] = statistics.median(res[label].pop("times"))
        shares = res[label].pop("busy")
        res[label]["idle"] = 1 - statistics.median(shares) if shares else None
    everyone = [None] * world
    dist.all_gather_object(everyone, res)
    if rank == 0:
        for label in res:  # the slowest rank's time, the fullest rank's traffic and memory, the mean idle share
            for key in ("step_s", "bytes", "calls", "p2p_bytes", "params", "peak_saved_bytes"):
                res[label][key] = max(e[label][key] for e in everyone)
            if res[label]["idle"] is not None:
                res[label]["idle"] = statistics.mean(e[label]["idle"] for e in everyone)
        res["total_param_bytes"] = sum(p.numel() * p.element_size() for p in base.parameters())
        with open(out, "w") as f:
            json.dump(res, f)
    close()


def markdown(res: dict) -> str:
    lines = ["| configuration | step (median) | received/rank/step | of which point to point | calls/rank/step | "
             "params/rank (x total/8) | peak saved for backward/rank | bubble measured / estimated |",
             "|---|---|---|---|---|---|---|---|"]
    total = res["total_param_bytes"]
    for label, kw in CONFIGS.items():
        r = res[label]
        pipe = kw.get("pipeline")
        est = bubble(pipe.schedule, pipe.stages, pipe.n_microbatches, pipe.stages_per_rank) if pipe else None
        bub = f"{r['idle']:.0%} / {est:.0%}" if pipe else "-"
        lines.append(f"| {label} | {r['step_s'] * 1e3:.0f} ms | {r['bytes'] / 2**20:.2f} MiB | "
                     f"{r['p2p_bytes'] / 2**20:.2f} MiB | {r['calls']} | {r['params'] / 2**20:.2f} MiB "
                     f"({r['params'] / (total / WORLD):.2f}) | {r['peak_saved_bytes'] / 2**20:.1f} MiB | {bub} |")
    fields = (("step", "step_s"), ("received", "bytes"), ("peak saved", "peak_saved_bytes"))
    return "\n".join(lines + [""] + common.against(res, CONFIGS, "2x4 (2D)", "2x4", fields))


def run(ns) -> int:
    """The pipeline benchmark for `autopar bench`'s parsed flags (--rounds, --steps, --json)."""
    res = common.spawn_json(worker, WORLD, ns.rounds, ns.steps, CONFIGS)
    common.report(ns, res, f"Llama-style model {common.CONFIG}, global batch {common.BATCH} x {common.SEQ} tokens, "
                           f"8 ranks, fp32, AdamW, gloo on CPU\n\n" + markdown(res))
    return 0
