"""Benchmark: the two SUMMA lowerings (broadcast-stepwise vs all-gather) on 4 local gloo ranks.

Prints the median time of a training step (forward + backward) of a GPT block stack for each
lowering, their ratio, and the bytes each moved per rank (equal by construction). Run it with
`make bench`; numbers from a 2-core machine are noisy, so each is the median of several steps.
"""

import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import autopar  # noqa: E402
from autopar.launch import spawn  # noqa: E402
from models import GPTConfig, TinyGPT  # noqa: E402

CONFIGS = [
    dict(vocab_size=512, max_seq=64, hidden=256, heads=8, layers=2),
    dict(vocab_size=512, max_seq=64, hidden=512, heads=8, layers=2),
]
BATCH, SEQ, WARMUP, STEPS = 8, 64, 2, 7


def step_times(pm, ids, tgt):
    times = []
    for i in range(WARMUP + STEPS):
        dist.barrier()
        t0 = time.perf_counter()
        _, loss = pm(ids, tgt)
        loss.backward()
        dist.barrier()
        if i >= WARMUP:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(rank):
    for cfg_kw in CONFIGS:
        torch.manual_seed(0)
        model = TinyGPT(GPTConfig(**cfg_kw))
        ids = torch.randint(0, cfg_kw["vocab_size"], (BATCH, SEQ))
        tgt = torch.randint(0, cfg_kw["vocab_size"], (BATCH, SEQ))
        res = {}
        for lowering in ("broadcast", "allgather"):
            pm = autopar.parallelize(model, grid=(2, 2), example_inputs=(ids, tgt), lowering=lowering)
            pm.grid.log.reset()
            _, loss = pm(ids, tgt)
            loss.backward()
            moved = pm.grid.log.total()
            res[lowering] = (step_times(pm, ids, tgt), moved)
        if rank == 0:
            (tb, mb), (ta, ma) = res["broadcast"], res["allgather"]
            print(f"hidden={cfg_kw['hidden']} layers={cfg_kw['layers']} batch={BATCH} seq={SEQ} (2x2, gloo, CPU)")
            print(f"  broadcast : {tb * 1e3:8.1f} ms/step  {mb / 2**20:6.2f} MiB received per rank")
            print(f"  allgather : {ta * 1e3:8.1f} ms/step  {ma / 2**20:6.2f} MiB received per rank")
            print(f"  allgather / broadcast time ratio: {ta / tb:.2f}")


if __name__ == "__main__":
    spawn(main, 4)
