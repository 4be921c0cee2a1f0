"""Benchmark: SUMMA weight-gradient reductions overlapped with the input gradient's product, or in line.

The benchmark Llama of `autopar bench` (autopar.bench.CONFIG, batch 8 x 128) on a 2x2 grid of 4 local
gloo ranks, one model per lowering; each training step (forward, backward, AdamW step) runs with the
grid's `overlap_grad_reduce` on, then off, alternated step by step so that the machine's load falls on
both alike. Prints the median step and backward time of each, their ratio, the machine's load average,
and checks that both settings receive the same bytes with the same collective calls.

    PYTHONPATH=. python examples/bench_overlap.py [steps]
"""

import copy
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import autopar  # noqa: E402
from autopar.bench import common  # noqa: E402
from autopar.launch import spawn  # noqa: E402

WARMUP = 2


def _step(pm, opt, step: int) -> tuple:
    """(step seconds, backward seconds) of one training step, every rank timed between barriers."""
    dist.barrier()
    t0 = time.perf_counter()
    loss = pm(**common.batch(step)).loss
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    opt.step()
    opt.zero_grad()
    dist.barrier()
    return time.perf_counter() - t0, t2 - t1


def _traffic(pm, overlap: bool) -> tuple:
    pm.grid.overlap_grad_reduce = overlap
    pm.grid.log.reset()
    pm(**common.batch(0)).loss.backward()
    pm.zero_grad()
    return dict(pm.grid.log.bytes), dict(pm.grid.log.launches)


def main(rank, steps: int):
    base = common.model()
    load0 = os.getloadavg()
    for lowering in ("broadcast", "allgather"):
        pm = autopar.parallelize(copy.deepcopy(base), grid=(2, 2), example_kwargs=common.batch(0), lowering=lowering)
        traffic = _traffic(pm, True)
        same = traffic == _traffic(pm, False)
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-4)
        times: dict = {True: [], False: []}
        for s in range(WARMUP + steps):
            for overlap in (True, False):
                pm.grid.overlap_grad_reduce = overlap
                t = _step(pm, opt, s + 1)
                if s >= WARMUP:
                    times[overlap].append(t)
        if rank == 0:
            med = {k: [statistics.median(x[i] for x in v) for i in range(2)] for k, v in times.items()}
            (on, on_b), (off, off_b) = med[True], med[False]
            print(f"2x2 {lowering}: overlapped {on * 1e3:.0f} ms/step (backward {on_b * 1e3:.0f} ms), in line "
                  f"{off * 1e3:.0f} ms/step (backward {off_b * 1e3:.0f} ms); overlapped/in line {on / off:.3f} "
                  f"(backward {on_b / off_b:.3f}); {sum(traffic[0].values()) / 2**20:.1f} MiB and "
                  f"{sum(traffic[1].values())} calls per rank per step, same both ways: {same}; median of {steps}",
                  flush=True)
    if rank == 0:
        print(f"load average (1, 5, 15 min) at start {load0}, at end {os.getloadavg()}; CPUs {os.cpu_count()}")


if __name__ == "__main__":
    spawn(main, 4, int(sys.argv[1]) if len(sys.argv) > 1 else 10)
