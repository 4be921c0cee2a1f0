"""`python -m autopar bench --cube`: 3D tensor parallelism against 2D and 1D on 8 gloo ranks.

The benchmark Llama (`autopar.bench.common`, 4 layers, hidden 256) trained with AdamW on the same batch
(8 x 128 tokens) four ways: a 2x2x2 cube (strategy='3d'), 2x4 and 4x2 grids (2D) and a 1x8 grid (1D),
by `autopar.bench.pipeline`'s worker. Per configuration: the median step (the slowest rank's), bytes
received per rank per step and collective calls, the parameter bytes a rank holds, and the peak of the
bytes autograd holds saved for backward. Configurations alternate round by round. Eight processes share
two cores here: the times measure contention as much as the layouts.
"""

from __future__ import annotations

from autopar.bench import common
from autopar.bench.pipeline import worker

WORLD = 8
CONFIGS = {
    "3D 2x2x2": dict(grid=(2, 2, 2), strategy="3d"),
    "2D 2x4": dict(grid=(2, 4)),
    "2D 4x2": dict(grid=(4, 2)),
    "1D 1x8": dict(grid=(1, 8), strategy="1d"),
}


def markdown(res: dict) -> str:
    lines = ["| configuration | step (median) | received/rank/step | calls/rank/step | params/rank | "
             "peak saved for backward/rank |", "|---|---|---|---|---|---|"]
    for label in CONFIGS:
        r = res[label]
        lines.append(f"| {label} | {r['step_s'] * 1e3:.0f} ms | {r['bytes'] / 2**20:.2f} MiB | {r['calls']} | "
                     f"{r['params'] / 2**20:.2f} MiB | {r['peak_saved_bytes'] / 2**20:.1f} MiB |")
    fields = (("step", "step_s"), ("received", "bytes"), ("calls", "calls"), ("peak saved", "peak_saved_bytes"))
    return "\n".join(lines + [""] + common.against(res, CONFIGS, "2D 2x4", "2D 2x4", fields))


def run(ns) -> int:
    """The cube benchmark for `autopar bench`'s parsed flags (--rounds, --steps, --json)."""
    res = common.spawn_json(worker, WORLD, ns.rounds, ns.steps, CONFIGS)
    common.report(ns, res, markdown(res))
    return 0
