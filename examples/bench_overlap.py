"""Benchmark: communication behind compute (`overlap=True`) against every transfer waited for in line
(`overlap=False`), with the exposed communication measured.

The benchmark Llama of `autopar bench` (autopar.bench.CONFIG, batch 8 x 128) on gloo ranks of this
machine: 2D on a 2x2 grid in each SUMMA lowering, 1D (Megatron with sequence parallelism) on 1x4, 3D on
a 2x2x2 cube, and torchtitan's tensor-parallel plan (TP 4 + SP, through PyTorch's own API:
`autopar.bench.common.tp_sp`) beside them. For each autopar configuration one model trains with the
grid's overlap switched on and off step by step (in alternating order), so that the machine's load falls on
both alike:

- step: a training step (forward, backward, AdamW), every rank timed between barriers;
- exposed: the time the compute thread is blocked in communication during a step, from `torch.profiler`:
  the ranges autopar opens around each collective it issues and each wait for one it launched before
  (`passes.ops.comm.profiled`; an asynchronous launch counts only the time to post it), and for the
  PyTorch plan the functional collectives and their waits. Profiled steps are extra steps, run after
  all the timed ones (the profiler slows a step, and the step after it);
- bytes and calls per rank and step, checked equal with overlap on and off, and each setting's
  gradients after one backward on the same batch, checked bit-identical.

Medians over the steps (after a warm-up), each rank's figure averaged over the ranks.

    PYTHONPATH=. python examples/bench_overlap.py [--steps N] [--json] [--only 4|8] [--configs LABEL ...]
"""

import argparse
import contextlib
import copy
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import autopar  # noqa: E402
from autopar.bench import common  # noqa: E402
from passes.ops import comm  # noqa: E402

WARMUP = 2
FOUR = {  # label -> parallelize keywords, on 4 ranks
    "2D 2x2 broadcast": dict(grid=(2, 2), lowering="broadcast"),
    "2D 2x2 allgather": dict(grid=(2, 2), lowering="allgather"),
    "2D 2x2 ring": dict(grid=(2, 2), lowering="ring"),
    "1D 1x4 (+SP)": dict(grid=(1, 4), strategy="1d"),
}
EIGHT = {"3D 2x2x2": dict(grid=(2, 2, 2), strategy="3d")}
TORCH = "torchtitan TP 4 + SP (PyTorch)"


def _set(pm, on: bool) -> None:
    pm.grid.prefetch = pm.grid.overlap_grad_reduce = on  # a cube's depth grids read its grid's


def _exposed_s(prof) -> float:
    """Seconds the profiled thread spent inside communication ranges: autopar's own ('autopar::comm ...'),
    or PyTorch's functional collectives and their waits; a range inside another counted once."""
    def comm_event(e) -> bool:
        return e.name.startswith("autopar::comm ") or "c10d" in e.name or e.name.endswith("wait_tensor")

    total = 0.0
    for e in prof.events():
        if comm_event(e) and not (e.cpu_parent is not None and comm_event(e.cpu_parent)):
            total += e.cpu_time_total / 1e6
    return total


def _train(model, opt, step: int) -> None:
    common.forward_backward(model, common.batch(step))
    opt.step()
    opt.zero_grad()


def _timed(model, opt, step: int) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    _train(model, opt, step)
    dist.barrier()
    return time.perf_counter() - t0


@contextlib.contextmanager
def _quiet_stderr():
    """The profiler's native layer prints a line to stderr at each start and stop: silenced here (an
    exception still propagates, and prints once stderr is back)."""
    sys.stderr.flush()
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


def _profiled(model, opt, step: int) -> float:
    from torch.profiler import ProfilerActivity, profile

    dist.barrier()
    with _quiet_stderr(), comm.profiled(), profile(activities=[ProfilerActivity.CPU]) as prof:
        _train(model, opt, step)
    dist.barrier()
    return _exposed_s(prof)


def _same_both_ways(pm) -> dict:
    """Bytes, calls and gradients of one backward with overlap on and off, on the same batch."""
    seen = {}
    for on in (True, False):
        _set(pm, on)
        pm.grid.log.reset()
        pm(**common.batch(0)).loss.backward()
        grads = [p.grad.detach().clone() for p in pm.parameters() if p.grad is not None]
        seen[on] = (dict(pm.grid.log.bytes), dict(pm.grid.log.launches), grads)
        pm.zero_grad()
    (b1, l1, g1), (b0, l0, g0) = seen[True], seen[False]
    return {"bytes": sum(b1.values()), "calls": sum(l1.values()), "same_traffic": b1 == b0 and l1 == l0,
            "same_grads": len(g1) == len(g0) and all(torch.equal(x, y) for x, y in zip(g1, g0))}


def _order(s: int) -> tuple:
    """Round s's order of the two settings: on first in even rounds, off first in odd ones, so that neither
    always runs right after the other (a step that follows another setting's is not always the same one)."""
    return (True, False) if s % 2 == 0 else (False, True)


def _median(xs: list) -> float:
    return statistics.median(xs) if xs else float("nan")


def _mean_over_ranks(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def worker(rank, world, port, configs, steps, baseline, out):
    from autopar.launch import init_local

    init_local(rank, world, port)
    torch.set_num_threads(1)
    base = common.model()
    res = {}
    for label, kw in configs.items():
        pm = autopar.parallelize(copy.deepcopy(base), example_kwargs=common.batch(0), **kw)
        row = _same_both_ways(pm)
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-4)
        step, exposed = {True: [], False: []}, {True: [], False: []}
        for measure, into, skip in ((_timed, step, WARMUP), (_profiled, exposed, 1)):  # timed first, then profiled
            for s in range(skip + steps):
                for on in _order(s):
                    _set(pm, on)
                    x = measure(pm, opt, s + 1)
                    if s >= skip:
                        into[on].append(x)
        for on in (True, False):
            row[f"step_s_{'on' if on else 'off'}"] = _mean_over_ranks(_median(step[on]))
            row[f"exposed_s_{'on' if on else 'off'}"] = _mean_over_ranks(_median(exposed[on]))
        res[label] = row
        del pm, opt
    if baseline:  # torchtitan's TP 4 + SP plan through PyTorch's API, in the same run
        model = common.tp_sp(copy.deepcopy(base))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        step = [_timed(model, opt, s + 1) for s in range(WARMUP + steps)][WARMUP:]
        exposed = [_profiled(model, opt, s + 1) for s in range(1 + steps)][1:]
        res[TORCH] = {"step_s_on": _mean_over_ranks(_median(step)), "exposed_s_on": _mean_over_ranks(_median(exposed))}
    if rank == 0:
        with open(out, "w") as f:
            json.dump(res, f)
    dist.destroy_process_group()


def markdown(res: dict, steps: int) -> str:
    lines = ["| configuration | step, overlap on / off (ms) | ratio | exposed communication, on / off (ms) | ratio | "
             "exposed share of the step, on / off | MiB, calls per step (same both ways) | gradients bit-identical |",
             "|---|---|---|---|---|---|---|---|"]
    for label, r in res.items():
        on, off, eon, eoff = (r.get(k) for k in ("step_s_on", "step_s_off", "exposed_s_on", "exposed_s_off"))
        if off is None:  # the PyTorch plan: one setting (its collectives are waited for where DTensor puts them)
            lines.append(f"| {label} | {on * 1e3:.0f} | | {eon * 1e3:.0f} | | {eon / on:.0%} | | |")
            continue
        same = "yes" if r["same_traffic"] else "NO"
        lines.append(f"| {label} | {on * 1e3:.0f} / {off * 1e3:.0f} | {on / off:.3f} | {eon * 1e3:.0f} / "
                     f"{eoff * 1e3:.0f} | {eon / eoff:.3f} | {eon / on:.0%} / {eoff / off:.0%} | "
                     f"{r['bytes'] / 2**20:.1f}, {r['calls']} ({same}) | {'yes' if r['same_grads'] else 'NO'} |")
    lines.append(f"\nMedians of {steps} steps after {WARMUP} of warm-up (profiled: after 1), each rank's median "
                 f"averaged over the ranks; load average (1, 5, 15 min) at the end "
                 f"{tuple(round(x, 2) for x in os.getloadavg())}, {os.cpu_count()} CPUs.")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5, help="measured steps per setting (default 5)")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    ap.add_argument("--only", choices=("4", "8"), help="run only the 4-rank or the 8-rank configurations")
    ap.add_argument("--configs", nargs="+", metavar="LABEL", choices=[*FOUR, *EIGHT],
                    help="run only these configurations (their labels, as the table names them)")
    ns = ap.parse_args(argv)
    res = {}
    four, eight = ({k: v for k, v in c.items() if not ns.configs or k in ns.configs} for c in (FOUR, EIGHT))
    if ns.only != "8" and four:
        res.update(common.spawn_json(worker, 4, four, ns.steps, not ns.configs))
    if ns.only != "4" and eight:
        res.update(common.spawn_json(worker, 8, eight, ns.steps, False))
    print(json.dumps(res, indent=2) if ns.json else markdown(res, ns.steps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
