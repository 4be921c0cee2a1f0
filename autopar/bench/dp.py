"""`python -m autopar bench --dp`: sharded against replicated replicas of a 2x2 grid on 8 gloo ranks.

The benchmark Llama (`autopar.bench.common`) at grid (2, 2, 2), trained with AdamW on the global batch
(8 x 128 tokens, each replica its 4 rows), once with data_parallel='replicate' (each replica holds its
grid block of every parameter, gradient and AdamW state; gradients all-reduced in buckets) and once
with 'shard' (FSDP2 over the replicas: 1/2 of the block each; each decoder layer a unit, released after
its forward, or with reshard_after_forward=False kept until its backward). Per configuration: the median step
(forward, backward, optimizer; the slowest rank's), bytes received per rank per step and collective
calls (the grid's and the replica axis's, from the collective layer), what a rank holds between steps
(parameters, gradients, AdamW states), the peak of live tensors during a step, and the losses, which
must be the same both ways. Configurations alternate round by round.
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
from autopar.parallel.sharded import memory_per_rank
from passes.compat import peak_tensor_bytes

GRID = (2, 2, 2)
# label -> parallelize options; 'shard' makes each decoder layer an FSDP2 unit, released after its
# forward (FSDP2's default); 'shard, kept' keeps the gathered layers from forward to backward
MODES = {"replicate": dict(data_parallel="replicate"), "shard": dict(data_parallel="shard"),
         "shard, kept": dict(data_parallel="shard", reshard_after_forward=False)}


def _rows(step, dp: int, replica: int) -> dict:
    """Replica `replica`'s rows of the global batch of `step`."""
    mine = common.BATCH // dp
    return {k: v[mine * replica:mine * (replica + 1)] for k, v in common.batch(step).items()}


def _step(pm, opt, step, held: dict | None = None) -> float:
    """One training step; `held`, if given, gets what the rank holds after the optimizer's step (before
    the gradients are dropped)."""
    loss = pm(**_rows(step, pm.grid.dp, pm.grid.dp_index)).loss
    loss.backward()
    opt.step()
    if held is not None:
        held.update(memory_per_rank(pm, opt))
    opt.zero_grad()
    return float(loss.detach())


def worker(rank, world, port, rounds, steps, out):
    init_local(rank, world, port)
    base = common.model()
    configs, opts, res = {}, {}, {}
    for mode, options in MODES.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pm = autopar.parallelize(copy.deepcopy(base), grid=GRID, example_kwargs=_rows(0, GRID[0], 0), **options)
        configs[mode], opts[mode] = pm, torch.optim.AdamW(pm.parameters(), lr=1e-4)
        res[mode] = {"times": [], "losses": []}
    for mode, pm in configs.items():  # one measured step each: bytes, calls, memory
        pm.grid.log.reset()
        res[mode]["held"] = {}
        res[mode]["losses"].append(_step(pm, opts[mode], 0, res[mode]["held"]))
        res[mode]["bytes"], res[mode]["calls"] = pm.grid.log.total(), pm.grid.log.calls()
        step = functools.partial(_step, pm, opts[mode], 1)
        res[mode]["peak_tensor_bytes"] = peak_tensor_bytes(step, torch.device("cpu"))
    for r in range(rounds):
        for mode, pm in configs.items():
            for s in range(steps):
                dist.barrier()
                t0 = time.perf_counter()
                res[mode]["losses"].append(_step(pm, opts[mode], 2 + r * steps + s))
                res[mode]["times"].append(time.perf_counter() - t0)
    for mode in configs:
        res[mode]["step_s"] = statistics.median(res[mode].pop("times"))
    everyone = [None] * world
    dist.all_gather_object(everyone, res)
    if rank == 0:
        for mode in res:  # the slowest rank's time, the fullest rank's memory and traffic
            res[mode]["step_s"] = max(e[mode]["step_s"] for e in everyone)
            for key in ("bytes", "calls", "peak_tensor_bytes"):
                res[mode][key] = max(e[mode][key] for e in everyone)
            res[mode]["held"] = {k: max(e[mode]["held"][k] for e in everyone) for k in res[mode]["held"]}
        res["total_param_bytes"] = sum(p.numel() * p.element_size() for p in base.parameters())
        with open(out, "w") as f:
            json.dump(res, f)
    close()


def markdown(res: dict) -> str:
    """One line per data_parallel mode, and the shard/replicate ratios."""
    world = GRID[0] * GRID[1] * GRID[2]
    total = res["total_param_bytes"]
    lines = ["| data_parallel | step (median) | received/rank/step | calls/rank/step | params/rank | "
             "params+grads+AdamW/rank | x total/(d*R*C) | peak tensors/rank |", "|---|---|---|---|---|---|---|---|"]
    for mode in MODES:
        r = res[mode]
        held = sum(r["held"].values())
        lines.append(f"| {mode} | {r['step_s'] * 1e3:.0f} ms | {r['bytes'] / 2**20:.1f} MiB | {r['calls']} | "
                     f"{r['held']['params'] / 2**20:.2f} MiB | {held / 2**20:.2f} MiB | "
                     f"{held / (4 * total / world):.2f} | {r['peak_tensor_bytes'] / 2**20:.1f} MiB |")
    b = res["replicate"]
    lines.append("")
    for mode in MODES:
        a = res[mode]
        if a is b:
            continue
        worst = max(abs(x - y) / abs(y) for x, y in zip(a["losses"], b["losses"]))
        held = sum(a["held"].values()) / sum(b["held"].values())
        lines.append(f"{mode} / replicate: step {a['step_s'] / b['step_s']:.2f}x, "
                     f"received {a['bytes'] / b['bytes']:.2f}x, held between steps {held:.2f}x, peak tensors "
                     f"{a['peak_tensor_bytes'] / b['peak_tensor_bytes']:.2f}x; losses agree to {worst:.1e} (relative)")
    return "\n".join(lines)


def run(ns) -> int:
    """The sharded-replica benchmark for `autopar bench`'s parsed flags (--rounds, --steps, --json)."""
    res = common.spawn_json(worker, GRID[0] * GRID[1] * GRID[2], ns.rounds, ns.steps)
    common.report(ns, res, f"Llama-style model {common.CONFIG}, global batch {common.BATCH} x {common.SEQ} tokens, "
                           f"grid {GRID} (2 replicas of 2x2), fp32, AdamW, gloo on CPU\n\n" + markdown(res), grid=GRID)
    return 0
