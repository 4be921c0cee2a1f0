"""`python -m autopar bench --cube`: 3D tensor parallelism against 2D and 1D on 8 gloo ranks.

The benchmark Llama (`autopar.bench.common`, 4 layers, hidden 256) trained with AdamW on the same batch
(8 x 128 tokens) four ways: a 2x2x2 cube (strategy='3d'), 2x4 and 4x2 grids (2D) and a 1x8 grid (1D).
Per configuration: the median step (the slowest rank's), bytes received per rank per step and collective
calls, the parameter bytes a rank holds, and the peak of the bytes autograd holds saved for backward
(`autopar.bench.pipeline`'s measure). Configurations alternate round by round. Eight processes share two
cores here: the times measure contention as much as the layouts.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import statistics
import time
import warnings

import torch
import torch.distributed as dist

import autopar
from autopar.bench import common
from autopar.bench.pipeline import one_step, peak_saved
from autopar.launch import close, init_local

WORLD = 8
CONFIGS = {
    "3D 2x2x2": dict(grid=(2, 2, 2), strategy="3d"),
    "2D 2x4": dict(grid=(2, 4)),
    "2D 4x2": dict(grid=(4, 2)),
    "1D 1x8": dict(grid=(1, 8), strategy="1d"),
}


def worker(rank, world, port, rounds, steps, out):
    init_local(rank, world, port)
    base = common.model()
    pms, opts, res = {}, {}, {}
    for label, kw in CONFIGS.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pm = autopar.parallelize(copy.deepcopy(base), example_kwargs=common.batch(0), **kw)
        pms[label], opts[label] = pm, torch.optim.AdamW(pm.parameters(), lr=1e-4)
        res[label] = {"times": [], "losses": []}
    for label, pm in pms.items():
        pm.grid.log.reset()
        res[label]["losses"].append(one_step(pm, opts[label], 0))
        log = pm.grid.log
        res[label].update(bytes=log.total(), calls=log.calls(),
                          params=sum(p.to_local().numel() * p.element_size() for p in pm.parameters()))
        res[label]["peak_saved_bytes"] = peak_saved(functools.partial(one_step, pm, opts[label], 1))
    for r in range(rounds):
        for label, pm in pms.items():
            for s in range(steps):
                dist.barrier()
                t0 = time.perf_counter()
                res[label]["losses"].append(one_step(pm, opts[label], 2 + r * steps + s))
                res[label]["times"].append(time.perf_counter() - t0)
    for label in pms:
        res[label]["step_s"] = statistics.median(res[label].pop("times"))
    everyone: list = [None] * world
    dist.all_gather_object(everyone, res)
    if rank == 0:
        for label in res:
            for key in ("step_s", "bytes", "calls", "params", "peak_saved_bytes"):
                res[label][key] = max(e[label][key] for e in everyone)
        with open(out, "w") as f:
            json.dump(res, f)
    close()


def markdown(res: dict) -> str:
    lines = ["| configuration | step (median) | received/rank/step | calls/rank/step | params/rank | "
             "peak saved for backward/rank |", "|---|---|---|---|---|---|"]
    for label in CONFIGS:
        r = res[label]
        lines.append(f"| {label} | {r['step_s'] * 1e3:.0f} ms | {r['bytes'] / 2**20:.2f} MiB | {r['calls']} | "
                     f"{r['params'] / 2**20:.2f} MiB | {r['peak_saved_bytes'] / 2**20:.1f} MiB |")
    ref = res["2D 2x4"]
    lines.append("")
    for label in CONFIGS:
        a = res[label]
        worst = max(abs(x - y) / abs(y) for x, y in zip(a["losses"], ref["losses"]))
        lines.append(f"{label} / 2D 2x4: step {a['step_s'] / ref['step_s']:.2f}x, received "
                     f"{a['bytes'] / ref['bytes']:.2f}x, calls {a['calls'] / ref['calls']:.2f}x, peak saved "
                     f"{a['peak_saved_bytes'] / ref['peak_saved_bytes']:.2f}x; losses agree to {worst:.1e}")
    return "\n".join(lines)


def run(ns) -> int:
    """The cube benchmark for `autopar bench`'s parsed flags (--rounds, --steps, --json)."""
    import tempfile

    out = os.path.join(tempfile.mkdtemp(), "bench_cube.json")
    common.spawn(worker, WORLD, ns.rounds, ns.steps, out)
    with open(out) as f:
        res = json.load(f)
    if ns.json:
        print(json.dumps({"model": common.CONFIG, "batch": common.BATCH, "seq": common.SEQ, "results": res},
                         indent=2))
    else:
        print(markdown(res))
    return 0
