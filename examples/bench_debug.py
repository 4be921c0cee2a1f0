"""What the debugging tools cost a training step: the flight recorder off (AUTOPAR_FLIGHT_CALLS=0's
state), on (the default, 2,000 calls kept), and a step recorded by `autopar.report`; TinyGPT on a 2x2
grid of 4 gloo processes, the three interleaved round by round so that a busy machine slows them alike.
Prints each one's median step time and its ratio to the recorder off (rank 0).

    python examples/bench_debug.py [--rounds 5] [--layers 2] [--batch 8] [--seq 32] [--hidden 64]
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from autopar.launch import spawn  # noqa: E402


def worker(rank, ns):
    torch.set_num_threads(1)
    import autopar
    from models import GPTConfig, TinyGPT
    from passes.ops import flight

    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    cfg = GPTConfig(layers=ns.layers, max_seq=ns.seq, hidden=ns.hidden)
    ids = torch.randint(0, cfg.vocab_size, (ns.batch, ns.seq), generator=torch.Generator().manual_seed(1))
    pm = autopar.parallelize(TinyGPT(cfg), grid=(2, 2), example_inputs=(ids, ids))
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-4)

    def step():
        pm(ids, ids)[1].backward()
        opt.step()
        opt.zero_grad()

    kept = flight.FLIGHT.calls
    step()
    times = collections.defaultdict(list)
    for _ in range(ns.rounds):
        for mode in ("recorder off", "recorder on", "report"):
            flight.FLIGHT.calls = collections.deque(maxlen=0) if mode == "recorder off" else kept
            torch.distributed.barrier()
            if mode == "report":
                with autopar.report(pm, steps=1, out=None) as rep:
                    t0 = time.perf_counter()
                    step()
                    rep.step()
                    times[mode].append(time.perf_counter() - t0)
            else:
                t0 = time.perf_counter()
                step()
                times[mode].append(time.perf_counter() - t0)
    if rank == 0:
        base = statistics.median(times["recorder off"])
        calls = pm.grid.log.calls() // (3 * ns.rounds + 1)
        print(f"TinyGPT layers={ns.layers} batch={ns.batch} seq={ns.seq}, grid 2x2, {ns.rounds} rounds, "
              f"{calls} collective calls per step (rank 0)")
        for mode, ts in times.items():
            med = statistics.median(ts)
            print(f"  {mode:<13} median step {med * 1e3:8.1f} ms  ({med / base:.2f}x the recorder off)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--hidden", type=int, default=64)
    spawn(worker, 4, p.parse_args())


if __name__ == "__main__":
    main()
