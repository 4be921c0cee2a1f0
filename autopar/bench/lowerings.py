"""`python -m autopar bench --lowerings`: one SUMMA product in each lowering, its temporary memory, bytes,
calls and time, on a 2x2 and a 3x3 grid of gloo ranks.

The product is one linear of a Llama-7B-shaped layer cut down to fit here: x [M, K] times W [K, N] with
M = 2304 tokens, K = N = 1152 (divisible by 2, 3, 4 and 6), fp32. For each lowering (broadcast,
all-gather, ring) and each of the three products a training step runs (AB forward; ABT and ATB
backward), on every rank: the peak of the bytes the product allocates beyond its operands while it
runs (its received pieces or panels, partial sums, and its result; counted from the storages each op
creates, freed when they die: `LiveAllocations`), the result's bytes, the bytes received and the calls
launched (the collective log), and the median time of 5 runs. Each figure is the largest over the
ranks. Gloo on two shared cores: the times measure contention as much as the lowerings.
"""

from __future__ import annotations

import json
import statistics
import time

import torch
import torch.distributed as dist

from autopar.bench import common
from autopar.launch import close, init_local
from passes.compat import TorchDispatchMode, pytree
from passes.mesh import Grid
from passes.ops import summa

GRIDS = ((2, 2), (3, 3))
LOWERINGS = ("broadcast", "allgather", "ring")
M, K, N = 2304, 1152, 1152
RUNS = 5


class LiveAllocations(TorchDispatchMode):
    """The bytes of the storages that the ops run inside create and that are still alive, after each op,
    and their peak. A storage an op's input already uses (a view, an in-place op) is not new."""

    def __init__(self):
        super().__init__()
        self.live: dict = {}  # storage data pointer -> (weak reference, bytes)
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        seen = {t.untyped_storage().data_ptr() for t in pytree.tree_leaves((args, kwargs))
                if isinstance(t, torch.Tensor)}
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes():
                ptr = t.untyped_storage().data_ptr()
                if ptr not in seen and ptr not in self.live:
                    self.live[ptr] = (torch.multiprocessing.reductions.StorageWeakRef(t.untyped_storage()),
                                      t.untyped_storage().nbytes())
        self.live = {p: v for p, v in self.live.items() if not v[0].expired()}
        self.peak = max(self.peak, sum(n for _, n in self.live.values()))
        return out


def _operands(grid: Grid, kind: str) -> tuple:
    """This rank's blocks of the product's operands (see `passes.ops.summa`)."""
    R, C = grid.shape
    g = torch.Generator().manual_seed(grid.rank)
    x = torch.randn(M // R, K // C, generator=g)
    if kind == "ab":
        return x, torch.randn(K // R, N // C, generator=g)  # x [M, K], W [K, N]
    if kind == "abt":
        return torch.randn(M // R, N // C, generator=g), torch.randn(K // R, N // C, generator=g)  # dY, W: dX
    return x, torch.randn(M // R, N // C, generator=g)  # x, dY: dW


def worker(rank, world, port, grid_shape, out):
    init_local(rank, world, port)
    grid = Grid(*grid_shape)
    res: dict = {}
    for lowering in LOWERINGS:
        for kind in ("ab", "abt", "atb"):
            a, b = _operands(grid, kind)
            fn = {"ab": summa.ab, "abt": summa.abt, "atb": summa.atb}[kind]
            grid.log.reset()
            track = LiveAllocations()
            with track:
                result = fn(grid, a, b, "bench", lowering=lowering)
            row = {"peak": track.peak, "result": result.numel() * result.element_size(),
                   "bytes": grid.log.total(), "calls": grid.log.calls()}
            del result
            times = []
            for _ in range(RUNS):
                dist.barrier()
                t0 = time.perf_counter()
                fn(grid, a, b, "bench", lowering=lowering)
                times.append(time.perf_counter() - t0)
            row["s"] = statistics.median(times)
            res[f"{lowering} {kind}"] = row
    everyone: list = [None] * world
    dist.all_gather_object(everyone, res)
    if rank == 0:
        worst = {key: {k: max(e[key][k] for e in everyone) for k in res[key]} for key in res}
        with open(out, "w") as f:
            json.dump(worst, f)
    close()


def markdown(results: dict) -> str:
    lines = ["| grid | lowering | product | peak temporary (incl. result) | result | received | calls | time |",
             "|---|---|---|---|---|---|---|---|"]
    for grid, res in results.items():
        for key, r in res.items():
            lowering, kind = key.split()
            lines.append(f"| {grid} | {lowering} | {kind.upper()} | {r['peak'] / 2**20:.2f} MiB | "
                         f"{r['result'] / 2**20:.2f} MiB | {r['bytes'] / 2**20:.2f} MiB | {r['calls']} | "
                         f"{r['s'] * 1e3:.0f} ms |")
    lines.append("")
    for grid, res in results.items():
        for kind in ("ab", "abt", "atb"):
            base = res[f"broadcast {kind}"]
            lines.append(f"{grid} {kind.upper()}: temporary over the result, allgather "
                         f"{_over(res[f'allgather {kind}']) / max(_over(base), 1):.2f}x and ring "
                         f"{_over(res[f'ring {kind}']) / max(_over(base), 1):.2f}x the broadcast lowering's")
    return "\n".join(lines)


def _over(r: dict) -> int:
    return r["peak"] - r["result"]


def run(ns) -> int:
    """The lowering benchmark for `autopar bench`'s parsed flags (--json)."""
    results = {f"{R}x{C}": common.spawn_json(worker, R * C, (R, C)) for R, C in GRIDS}
    if ns.json:
        print(json.dumps({"M": M, "K": K, "N": N, "results": results}, indent=2))
    else:
        print(f"One SUMMA product, x [{M}, {K}] . W [{K}, {N}] fp32, per rank (the largest over the ranks)\n")
        print(markdown(results))
    return 0
