"""`python -m autopar bench`: step time, bytes, parameter and activation memory and peak RSS, measured
in one run for the same transformers Llama-style model (built from its config class) as:

- one process, no parallelism;
- autopar 2D on a 2x2 grid, for each SUMMA lowering, and with each activation recomputation mode
  (recompute='blocks', 'selective');
- PyTorch's own 1D tensor parallel (`parallelize_module`, q/k/v/gate/up column-wise, o/down row-wise)
  on 4 ranks, and the plan torchtitan applies through the same API: that with sequence parallelism
  and a vocabulary-parallel loss (`common.tp_sp`);
- autopar strategy='1d' on a 1x4 grid (Megatron column/row pairs in autopar's engine);
- autopar strategy='auto' on the grid shape `choose_grid` picks for 4 ranks, with the alpha-beta
  model measured here first (`autopar calibrate` on 2x2, unless --cost-model names a file), and
  each autopar configuration's estimated step time next to the measured one;

and, unless --no-compile, the same step under torch.compile (inductor) for autopar 2D 2x2
(`compile=True`) and PyTorch's 1D tensor parallel (`torch.compile` of the model), with the
configurations alternated round by round and medians reported, plus the overhead of autopar on a 1x1
grid against the eager model (eager and compiled). Bytes are those received per rank per step: ours
counted by autopar's collective layer, PyTorch's counted from the functional collectives its DTensors
issue, with the same conventions (see passes.mesh.CommLog).
"""

from __future__ import annotations

import argparse
import copy
import functools
import importlib
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

import autopar
from autopar.bench import common
from autopar.bench.common import BATCH, CONFIG, SEQ, FunctionalCommBytes
from autopar.launch import close, init_local
from autopar.planning.progress import steps as progress_steps
from passes.compat import peak_tensor_bytes
from passes.options import DEFAULTS, Options

RECOMPUTE = ("blocks", "selective")  # 2D 2x2 (broadcast) with each recompute mode
TP_SP = "PyTorch 1D TP+SP (4 ranks)"  # torchtitan's plan: sequence parallel, loss over vocabulary blocks


def _estimate(model, grid, strategy, cost_model, lowering=DEFAULTS.lowering) -> float:
    """The planner's estimated step time (s) of one configuration (alpha-beta model), its SUMMA products
    in `lowering` as `parallelize(lowering=)` runs them ('auto': each at the one it prices faster)."""
    from passes.search import strategy as S
    from autopar.program.build import capture, resolve_cost_model

    gm = capture(model, (), common.batch(0)).gm
    cm = resolve_cost_model(cost_model)
    if strategy == "auto":
        return S.choose(gm, grid, cm).estimate.time_s
    return S.estimate_fixed(gm, grid, cm, strategy, lowering=Options(lowering=lowering).fixed_lowering).time_s


def _roofline(model, tp: tuple, assignment, cost_model) -> float:
    """`autopar.estimate`'s step time (s) for the benchmark's step on this machine, from the calibration
    (`passes.cost.cluster.from_calibration`): fp32, no recomputation, every rank a tensor-parallel one."""
    from autopar.planning.estimate import estimate

    tp = (tp[1],) if len(tp) == 2 and tp[0] == 1 else tuple(tp)  # a 1 x p grid is 1D over p
    return estimate(model, devices=4, cluster=cost_model, seq=common.SEQ, global_batch=common.BATCH, tp=tp,
                    precision="fp32", assignment=assignment).step_s


def calibrate_worker(rank, world, port, out):
    from autopar.planning.calibrate import measure, save, summary

    init_local(rank, world, port)
    model = measure((2, 2), (4096, 65536, 1 << 20), repeats=3)
    if rank == 0:
        save(model, out)
        print(summary(model), file=sys.stderr, flush=True)  # stdout stays the report (or its JSON)
    close()


COMPILED = " (compiled)"  # suffix of a configuration's compiled twin


def _compiled_configs(base) -> dict:
    """autopar 2D 2x2 and PyTorch 1D TP under torch.compile; each compiles on its first (warm-up) step."""
    return {"2D 2x2 broadcast" + COMPILED: autopar.parallelize(copy.deepcopy(base), grid=(2, 2),
                                                               example_kwargs=common.batch(0), compile=True,
                                                               lowering="broadcast"),
            "PyTorch 1D TP (4 ranks)" + COMPILED: torch.compile(common.tp_1d(copy.deepcopy(base)))}


def worker(rank, world, port, rounds, steps, out, cost_model, compiled=True):
    init_local(rank, world, port)
    configs, estimates = {}, {}
    base = common.model()
    if rank == 0:
        configs["one process"] = base
    for lowering in ("broadcast", "allgather"):
        configs[f"2D 2x2 {lowering}"] = autopar.parallelize(copy.deepcopy(base), grid=(2, 2),
                                                            example_kwargs=common.batch(0), lowering=lowering)
    for mode in RECOMPUTE:
        configs[f"2D 2x2 recompute={mode}"] = autopar.parallelize(copy.deepcopy(base), grid=(2, 2),
                                                              example_kwargs=common.batch(0), recompute=mode,
                                                              lowering="broadcast")
    configs["PyTorch 1D TP (4 ranks)"] = common.tp_1d(copy.deepcopy(base))
    configs[TP_SP] = common.tp_sp(copy.deepcopy(base))
    configs["autopar 1D 1x4"] = autopar.parallelize(copy.deepcopy(base), grid=(1, 4), example_kwargs=common.batch(0),
                                                    strategy="1d")
    grid, _table = autopar.choose_grid(base, world, (), common.batch(0), cost_model=cost_model,
                                       replica_layouts=False)  # the tensor-parallel arrangements compared here
    auto, auto_grid = f"autopar auto {grid[0]}x{grid[1]}", tuple(grid)
    configs[auto] = autopar.parallelize(copy.deepcopy(base), grid=grid, example_kwargs=common.batch(0), strategy="auto",
                                        cost_model=cost_model)
    estimates = {"2D 2x2 broadcast": _estimate(base, (2, 2), "2d", cost_model, "broadcast"),
                 "2D 2x2 allgather": _estimate(base, (2, 2), "2d", cost_model, "allgather"),
                 "autopar 1D 1x4": _estimate(base, (1, 4), "1d", cost_model),
                 auto: _estimate(base, grid, "auto", cost_model)}
    if compiled:
        configs.update(_compiled_configs(base))
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in configs.items()}
    times = {k: [] for k in configs}
    res = {k: {} for k in configs}
    for k, m in configs.items():  # bytes, memory: one measured step each
        if k.endswith(COMPILED):  # the same step as its eager twin: measured there (hooks and modes break graphs)
            continue
        counter = FunctionalCommBytes(world)
        common.reset_peak()
        grid = getattr(m, "grid", None)
        if grid is not None:
            grid.log.reset()
        with counter:
            common.forward_backward(m, common.batch(0))
        opts[k].step()
        opts[k].zero_grad()
        res[k]["bytes"] = grid.log.total() if grid is not None else counter.bytes
        res[k]["calls"] = grid.log.calls() if grid is not None else counter.calls
        res[k]["peak_rss_mb"] = common.peak_mb()
        res[k]["param_bytes"] = common.local_bytes(m)
        res[k]["saved_bytes"] = common.saved_bytes(m)
        step = functools.partial(common.train_step, m, opts[k], 1)
        res[k]["peak_tensor_bytes"] = peak_tensor_bytes(step, torch.device("cpu"))
    bar = progress_steps("autopar bench: timed rounds (rank 0)", rounds * len(configs))
    for r in range(rounds):  # alternate configurations round by round
        order = ([] if rank == 0 else [("one process", None)]) + list(configs.items())  # same order everywhere
        for k, m in order:
            bar.update(m is not None)
            bar.set_postfix_str(k)
            dist.barrier()
            if m is None:
                continue
            for s in range(steps):
                t0 = time.perf_counter()
                common.forward_backward(m, common.batch(s + 1))
                opts[k].step()
                opts[k].zero_grad()
                if r > 0 or s > 0:  # the first step of the first round is warm-up
                    times[k].append(time.perf_counter() - t0)
        dist.barrier()
    bar.close()
    res["2D 2x2 broadcast"]["input_check_s"] = _input_check_s(configs["2D 2x2 broadcast"], steps)
    if rank == 0:  # after the timed rounds: the roofline's estimates of the same steps, on this machine's constants
        for k, (tp, assignment) in {"2D 2x2 broadcast": ((2, 2), None), "autopar 1D 1x4": ((4,), None),
                                    auto: (auto_grid, configs[auto].program.choice.assignment)}.items():
            res[k]["roofline_step_s"] = _roofline(base, tp, assignment, cost_model)
    for k in configs:
        if k.endswith(COMPILED):
            res[k] = dict(res[k[:-len(COMPILED)]])
        res[k]["step_s"] = statistics.median(times[k])
        if k in estimates:
            res[k]["estimated_step_s"] = estimates[k]
    if rank == 0:
        res[auto]["assignment"] = configs[auto].program.choice.assignment
    everyone = [None] * world
    dist.all_gather_object(everyone, res)
    if rank == 0:
        merged = {}
        for k in res:
            merged[k] = {m: (max(r[k][m] for r in everyone if m in r.get(k, {})) if m != "assignment" else res[k][m])
                         for m in res[k]}
        with open(out, "w") as f:
            json.dump(merged, f)
    close()


def _input_check_s(pm, calls: int) -> float:
    """The median time of the input check every call of `pm` makes (check_inputs=True, the default):
    the checksums of the batch and one all-reduce over the grid."""
    times = []
    for s in range(calls + 1):
        dist.barrier()
        t0 = time.perf_counter()
        pm.check_inputs(**common.batch(s))
        if s:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def overhead_worker(rank, world, port, steps, out, compiled=True):
    """autopar on a 1x1 grid against the eager model, alternating step by step (and compiled)."""
    init_local(rank, world, port)
    eager = common.model()
    runs = {"eager": eager, "autopar 1x1": autopar.parallelize(copy.deepcopy(eager), grid=(1, 1),
                                                                 example_kwargs=common.batch(0))}
    if compiled:
        runs["autopar 1x1" + COMPILED] = autopar.parallelize(copy.deepcopy(eager), grid=(1, 1),
                                                             example_kwargs=common.batch(0), compile=True)
    t: dict = {k: [] for k in runs}
    for s in range(steps + 1):
        for k, m in runs.items():
            t0 = time.perf_counter()
            m(**common.batch(s)).loss.backward()
            if s:
                t[k].append(time.perf_counter() - t0)
    with open(out, "w") as f:
        json.dump({k: statistics.median(v) for k, v in t.items()}, f)
    close()


def markdown(res: dict, overhead: dict) -> str:
    base = res["PyTorch 1D TP (4 ranks)"]
    lines = ["| configuration | step (median) | vs 1D | received/rank/step | collective calls/rank/step | "
             "params/rank | saved for bwd/rank | saved vs 1D | peak RSS/rank | peak tensors/rank |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for k, r in res.items():
        lines.append(f"| {k} | {r['step_s'] * 1e3:.0f} ms | {r['step_s'] / base['step_s']:.2f} | "
                     f"{r['bytes'] / 2**20:.1f} MiB | {r.get('calls', '')} | {r['param_bytes'] / 2**20:.1f} MiB | "
                     f"{r['saved_bytes'] / 2**20:.1f} MiB | {r['saved_bytes'] / base['saved_bytes']:.2f} | "
                     f"{r['peak_rss_mb']:.0f} MB | {r['peak_tensor_bytes'] / 2**20:.1f} MiB |")
    auto = next((k for k in res if k.startswith("autopar auto")), None)
    if auto:
        fixed = {k: res[k]["step_s"] for k in ("2D 2x2 broadcast", "2D 2x2 allgather", "PyTorch 1D TP (4 ranks)",
                                               TP_SP, "autopar 1D 1x4")}
        best = min(fixed, key=fixed.get)
        lines.append(f"\n{auto}: {res[auto]['step_s'] * 1e3:.0f} ms measured, {res[auto]['step_s'] / fixed[best]:.2f}x "
                     f"the best fixed scheme ({best}, {fixed[best] * 1e3:.0f} ms); assignment "
                     f"{res[auto].get('assignment')}")
        lines.append("estimated (alpha-beta, calibrated here) vs measured step: " + "; ".join(
            f"{k} {r['estimated_step_s'] * 1e3:.0f} / {r['step_s'] * 1e3:.0f} ms" for k, r in res.items()
            if "estimated_step_s" in r))
        lines.append("autopar.estimate's roofline (calibrated here) vs measured step: " + "; ".join(
            f"{k} {r['roofline_step_s'] * 1e3:.0f} / {r['step_s'] * 1e3:.0f} ms "
            f"({r['roofline_step_s'] / r['step_s']:.2f}x)" for k, r in res.items() if "roofline_step_s" in r))
    check = res.get("2D 2x2 broadcast", {})
    if "input_check_s" in check:
        lines.append(f"\ninput check (check_inputs=True, the default; every call): {check['input_check_s'] * 1e3:.2f} "
                     f"ms, {check['input_check_s'] / check['step_s']:.2%} of the 2D 2x2 broadcast step")
    lines.append(f"\nautopar on a 1x1 grid: {overhead['autopar 1x1'] * 1e3:.0f} ms per forward+backward against "
                 f"{overhead['eager'] * 1e3:.0f} ms eager ({overhead['autopar 1x1'] / overhead['eager']:.2f}x)")
    return "\n".join(lines + compiled_lines(res, overhead))


def compiled_lines(res: dict, overhead: dict) -> list:
    """Step time compiled against eager for each configuration measured both ways (none without)."""
    pairs = [(k[:-len(COMPILED)], res[k]["step_s"], res[k[:-len(COMPILED)]]["step_s"]) for k in res
             if k.endswith(COMPILED)]
    if "autopar 1x1" + COMPILED in overhead:
        pairs.append(("autopar 1x1", overhead["autopar 1x1" + COMPILED], overhead["autopar 1x1"]))
    return ["\ntorch.compile (inductor) against eager, step time:"] + [
        f"- {k}: {c * 1e3:.0f} ms compiled, {e * 1e3:.0f} ms eager, ratio {c / e:.2f}" for k, c, e in pairs
    ] if pairs else []


def main(argv=None) -> int:
    from autopar.bench.args import add_bench_arguments

    parser = argparse.ArgumentParser(prog="autopar bench")
    add_bench_arguments(parser)
    return run(parser.parse_args(argv))


def run(ns) -> int:
    """The benchmark for parsed flags (see `autopar bench --help`); --generate runs
    `autopar.bench.generate` instead, --moe `autopar.bench.moe`, --dp `autopar.bench.dp`,
    --pipeline `autopar.bench.pipeline`, --lowerings `autopar.bench.lowerings`, --dimensions
    `autopar.bench.dimensions`, --cube `autopar.bench.cube`, --search `autopar.bench.search`."""
    import tempfile

    for flag in ("generate", "dp", "pipeline", "cube", "dimensions", "lowerings", "moe", "search",
                 "published"):  # one each
        if getattr(ns, flag, False):
            return importlib.import_module(f"autopar.bench.{flag}").run(ns)

    from autopar.planning.report import require_matplotlib

    plt = require_matplotlib("autopar bench --plot") if ns.plot else None  # before minutes of measuring
    tmp = tempfile.mkdtemp()
    cost_model = ns.cost_model
    bar = progress_steps("autopar bench", 3)
    if cost_model is None:
        bar.set_postfix_str("calibrating the cost model on 2x2")
        cost_model = os.path.join(tmp, "calibration.json")
        common.spawn(calibrate_worker, 4, cost_model)
    bar.update()
    compiled = not getattr(ns, "no_compile", False)
    bar.set_postfix_str("every configuration on 4 ranks")
    common.spawn(worker, 4, ns.rounds, ns.steps, os.path.join(tmp, "bench.json"), cost_model, compiled)
    bar.update()
    bar.set_postfix_str("autopar on a 1x1 grid against the eager model")
    common.spawn(overhead_worker, 1, 2 * ns.steps, os.path.join(tmp, "overhead.json"), compiled)
    bar.update()
    bar.close()
    res = json.load(open(os.path.join(tmp, "bench.json")))
    overhead = json.load(open(os.path.join(tmp, "overhead.json")))
    if ns.json:
        print(json.dumps({"model": CONFIG, "batch": BATCH, "seq": SEQ, "results": res, "overhead_1x1": overhead,
                          "cost_model": json.load(open(cost_model))}, indent=2))
    else:
        print(f"Llama-style model {CONFIG}, batch {BATCH} x {SEQ} tokens, gloo on CPU\n")
        print(markdown(res, overhead))
    if plt is not None:
        plot(plt, res, ns.plot)
    return 0


PANELS = (("step_s", 1e3, "{:.0f}", "step time (ms)"), ("bytes", 2**-20, "{:.1f}", "MiB received per rank per step"),
          ("saved_bytes", 2**-20, "{:.1f}", "MiB saved for backward per rank"))


def plot(plt, res: dict, path: str) -> None:
    """One bar per configuration of `res` (what --json prints under "results") for step time, bytes
    received and bytes saved for backward, in ms and MiB, each bar labelled with its value. The units
    keep the ticks short, so no offset text ("1e7") sits on the axis label; the configurations' names
    are written once, on the left."""
    names = list(res)
    fig, axes = plt.subplots(1, len(PANELS), figsize=(12, 0.45 * len(names) + 1.5), sharey=True,
                             layout="constrained")
    for ax, (key, scale, fmt, label) in zip(axes, PANELS):
        bars = ax.barh(names, [res[n][key] * scale for n in names])
        ax.bar_label(bars, fmt=fmt, padding=3)
        ax.margins(x=0.2)  # room for the labels of the longest bars
        ax.set_xlabel(label)
    axes[0].invert_yaxis()  # the configurations top to bottom, in the table's order
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
