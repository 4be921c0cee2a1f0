"""Benchmark: a Mixtral-style mixture of experts on 4 gloo ranks against one process.

A MixtralForCausalLM (hidden 256, 4 layers, 8 experts of intermediate 512, top-2, 8 heads, vocab
4096; batch 8 x 128, fp32, AdamW) trained for a few steps: one process, autopar 2D on 2x2 and on 1x4
(experts over the rows, each expert's intermediate dim over the columns). Per configuration: the
median step time, bytes received per rank per step (autopar's collective layer), the parameters one
rank holds against 1/p, and whether its losses match one process's (rtol 1e-4).

    .venv/bin/python examples/bench_moe.py [--steps 4] [--dispatch gather]   # see Options.moe_dispatch
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import autopar  # noqa: E402
from autopar.launch import free_port, init_local  # noqa: E402

GRIDS = ((2, 2), (1, 4))
# the model and batches of `python -m autopar bench --moe`, so the two measure the same thing
from autopar.bench.moe import batch, model  # noqa: E402,F401


def _train(model, steps, log=None) -> dict:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times, losses, moved = [], [], 0
    for step in range(steps):
        if log is not None:
            log.reset()
        t0 = time.perf_counter()
        loss = model(**batch(step)).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
        losses.append(float((loss.full_tensor() if hasattr(loss, "full_tensor") else loss).detach()))
        moved = log.total() if log is not None else 0
    return {"step_s": statistics.median(times[1:] or times), "losses": losses, "bytes": moved}


def worker(rank, world, port, steps, out, dispatch="auto"):
    init_local(rank, world, port)
    res = {}
    for grid in GRIDS:
        pm = autopar.parallelize(model(), grid=grid, example_kwargs=batch(0), moe_dispatch=dispatch)
        r = _train(pm, steps, pm.grid.log)
        held = sum(p.to_local().numel() for p in pm.parameters())
        total = sum(p.numel() for p in pm.parameters())
        r["params_x_1_over_p"] = held * world / total
        res[f"autopar 2D {grid[0]}x{grid[1]}"] = r
    gathered = [None] * world if rank == 0 else None
    torch.distributed.gather_object(res, gathered, dst=0)
    if rank == 0:
        worst = {k: max(g[k]["params_x_1_over_p"] for g in gathered) for k in res}
        for k in res:
            res[k]["params_x_1_over_p"] = worst[k]
        with open(out, "w") as f:
            json.dump(res, f)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--dispatch", choices=("auto", "all_to_all", "gather"), default="auto",
                    help="how routed tokens reach their experts (parallelize's moe_dispatch)")
    args = ap.parse_args(argv)
    import torch.multiprocessing as mp

    one = _train(model(), args.steps)
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "res.json")
        ctx = mp.get_context("spawn")
        port = free_port()
        procs = [ctx.Process(target=worker, args=(r, 4, port, args.steps, out, args.dispatch)) for r in range(4)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        with open(out) as f:
            res = json.load(f)
    print("| configuration | step (s) | received per rank per step | params per rank (x 1/p) | losses match |")
    print("|---|---|---|---|---|")
    print(f"| one process | {one['step_s']:.3f} | 0 | 4.00 | - |")
    for k, r in res.items():
        same = all(abs(a - b) <= 1e-4 * abs(b) for a, b in zip(r["losses"], one["losses"]))
        print(f"| {k} | {r['step_s']:.3f} | {r['bytes'] / 2**20:.1f} MiB | {r['params_x_1_over_p']:.2f} | {same} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
