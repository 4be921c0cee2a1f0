"""`autopar calibrate`: measure the alpha-beta communication model and the matmul rate on the machines
at hand, and store them as a small JSON file the planner reads.

The model per mesh axis is `time = alpha + bytes / beta`, with `bytes` the bytes *received per rank*
under the conventions of passes.mesh.CommLog (broadcast of N bytes -> N on a non-root; all-reduce of
N bytes -> 2(g-1)N/g on a group of g). Both collectives are timed at a few sizes in that axis's group
and one straight line is fitted to all the points, so alpha is the per-collective latency and beta
the per-rank bandwidth the planner should assume. An axis of size 1 never communicates: alpha 0 and
beta inf (written as null in JSON, since JSON has no infinity).

In memory a model is a dict (see `DEFAULT` for the schema) whose beta is a float, inf included;
`save` and `load` convert inf to null and back.
"""

from __future__ import annotations

import os
import statistics
import time
from datetime import datetime, timezone

import torch
import torch.distributed as dist

from passes.cost.model import (AXIS_KEYS, DEFAULT, KEYS, OPTIONAL_KEYS, RERUN, VERSION, load, save,  # noqa: F401
                               summary, unit_axis, validate)
from passes.cost.volumes import all_reduce_mean_bytes, broadcast_bytes
from autopar.errors import UsageError

SIZES = (4096, 65536, 1 << 20, 4 << 20)  # bytes per collective: latency-bound up to bandwidth-bound
MATMUL_N = 1024  # [n, n] @ [n, n]: the matmul rate's shape unless the model's are given
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# ----------------------------------------------------------------------------------------- pure parts


def received_bytes(op: str, nbytes: int, group_size: int) -> float:
    """Bytes one rank receives for `op` on an `nbytes` tensor in a group of `group_size` (CommLog
    conventions: broadcast -> N on a non-root, all-reduce -> 2(g-1)N/g, a ring)."""
    if op == "broadcast":
        return float(broadcast_bytes(nbytes))
    if op == "all_reduce":  # unfloored: a fit of time against bytes reads a rate, not a count
        return all_reduce_mean_bytes(nbytes, group_size)
    raise UsageError(f"received_bytes: op {op!r} is not one of 'broadcast', 'all_reduce'")


def fit_alpha_beta(points) -> tuple[float, float]:
    """Least-squares fit of `seconds = alpha + bytes / beta` to [[bytes, seconds], ...], with alpha >= 0
    and 0 < beta < inf.

    A negative intercept is refitted through the origin (alpha = 0). A slope <= 0 (time flat or
    falling with size: noise dominates, e.g. only small messages) leaves no bandwidth to read off;
    then alpha is the mean time and beta the best throughput any point reached, max(bytes / seconds),
    which is a lower bound of the true beta (seconds >= bytes / beta at every point) and so errs on
    the pessimistic side.
    """
    if len(points) < 1:
        raise UsageError("fit_alpha_beta: no points to fit; measure at least one size")
    xs = [float(x) for x, _ in points]
    ts = [float(t) for _, t in points]
    if min(xs) <= 0 or min(ts) <= 0:
        raise UsageError(f"fit_alpha_beta: every point needs bytes > 0 and seconds > 0, got {points}")
    n, mx, mt = len(xs), sum(xs) / len(xs), sum(ts) / len(ts)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx > 0:
        slope = sum((x - mx) * (t - mt) for x, t in zip(xs, ts)) / sxx
        alpha = mt - slope * mx
    else:  # a single size: no intercept can be told apart; fit through the origin
        slope, alpha = -1.0, -1.0
    if alpha < 0:
        alpha, slope = 0.0, sum(x * t for x, t in zip(xs, ts)) / sum(x * x for x in xs)
    if slope <= 0:
        return sum(ts) / n, max(x / t for x, t in zip(xs, ts))
    return alpha, 1.0 / slope


# ----------------------------------------------------------------------------------------- measuring


def _timer(sync):
    """Seconds of one call of fn(), with the device synchronized on both sides."""
    def timed(fn):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - t0
    return timed


def _median_time(fn, repeats: int, timed, before=lambda: None) -> float:
    """Median over `repeats` timed calls of fn() after one untimed warm-up; before() runs untimed
    ahead of each call (a barrier, so all ranks start together)."""
    before()
    fn()
    times = []
    for _ in range(repeats):
        before()
        times.append(timed(fn))
    return statistics.median(times)


def _slowest(values: list[float], device) -> list[float]:
    """Elementwise max over all ranks of the default group: a collective is as slow as its slowest
    member, and the planner must assume that."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _axis_times(grid, axis: int, sizes, repeats: int, device, timed) -> list[tuple[float, float]]:
    """(bytes received per rank, median seconds on this rank) for broadcast and all-reduce of each size
    in the group of mesh `axis`."""
    group, g = grid.group(axis), grid.size(axis)
    root = grid.global_rank(axis, 0)  # broadcast takes a global rank
    out = []
    for nbytes in sizes:
        t = torch.zeros(nbytes // 4, dtype=torch.float32, device=device)
        real = t.numel() * t.element_size()
        ops = {"broadcast": lambda t=t: dist.broadcast(t, src=root, group=group),
               "all_reduce": lambda t=t: dist.all_reduce(t, group=group)}
        for op, fn in ops.items():
            sec = _median_time(fn, repeats, timed, before=lambda: dist.barrier(group=group))
            out.append((received_bytes(op, real, g), sec))
    return out


def matmul_seconds(repeats: int, device, timed, n: int = MATMUL_N, dtype=torch.float32, shape=None) -> float:
    """Median seconds of one [m, k] @ [k, n] (`shape`; default [n, n] @ [n, n]) in `dtype` on this rank, with
    the threads the caller set."""
    m, k, n = shape or (n, n, n)
    a = torch.randn(m, k, device=device).to(dtype)
    b = torch.randn(k, n, device=device).to(dtype)
    return _median_time(lambda: a @ b, repeats, timed)


def default_dtype(device) -> str:
    """What a model trains in there: bf16 on an accelerator, fp32 on the CPU."""
    return "fp32" if torch.device(device).type == "cpu" else "bf16"


def parse_shapes(text: str) -> tuple:
    """'MxKxN,MxKxN' -> ((M, K, N), ...): the products `calibrate --shapes` times."""
    out = []
    for word in text.split(","):
        try:
            m, k, n = (int(x) for x in word.lower().split("x"))
        except ValueError:
            raise UsageError(f"calibrate --shapes {text!r}: {word!r} is not MxKxN (e.g. 8192x4096x4096)") from None
        if min(m, k, n) < 1:
            raise UsageError(f"calibrate --shapes {text!r}: {word!r}: every size must be positive")
        out.append((m, k, n))
    return tuple(out)


def model_shapes(model, seq: int, batch: int = 1) -> tuple:
    """The distinct products (M, K, N) of `model` (a transformers config, its config.json or folder, or a
    published architecture's name: what `autopar.estimate` reads; one block and the rest: the LM head) on
    `batch` sequences of `seq` tokens, unsplit: what `calibrate --model` times."""
    from autopar.planning.architectures import MODELS, published_model
    from autopar.planning.estimate import load_model_source, model_profile

    named = isinstance(model, str) and not os.path.exists(model) and model in MODELS
    prof = model_profile(published_model(model) if named else load_model_source(model), seq)[0]  # M = seq
    return tuple(dict.fromkeys((batch * m, k, n) for m, k, n in (*prof.block.mm, *prof.outer.mm)))


def matmul_rates(dtype: str, shapes, seconds: list, device) -> dict:
    """The products `shapes` timed in `dtype` ('fp32', 'bf16', 'fp16') at `seconds` each: per shape its seconds
    and FLOP/s, and the rate of all of them together (their FLOPs over their seconds: what the model's products
    reach one after another). On CUDA, whether fp32 products may use TF32 (`torch.backends.cuda.matmul.allow_tf32`)."""
    rows = [{"m": m, "k": k, "n": n, "seconds": sec, "flops_per_s": 2 * m * k * n / sec}
            for (m, k, n), sec in zip(shapes, seconds)]
    tf32 = bool(torch.backends.cuda.matmul.allow_tf32) if torch.device(device).type == "cuda" else None
    return {"dtype": dtype, "tf32": tf32, "shapes": rows,
            "flops_per_s": sum(2 * m * k * n for m, k, n in shapes) / sum(seconds)}


def memory_seconds(repeats: int, device, timed, n: int = 1 << 22) -> tuple:
    """(median seconds, bytes moved) of one fp32 elementwise add of two n-element tensors into a third:
    what a memory-bound op reaches on this rank."""
    a, b, c = (torch.randn(n, device=device) for _ in range(3))
    return _median_time(lambda: torch.add(a, b, out=c), repeats, timed), 3 * 4 * n


def op_seconds(repeats: int, device, timed, ops: int = 200) -> float:
    """Median seconds one tiny op costs through autograd, forward and backward together: the floor a
    step of many small ops pays per op whatever their size (the interpreter, the autograd graph)."""
    x = torch.ones(8, device=device, requires_grad=True)

    def chain():
        y = x
        for _ in range(ops):
            y = y * 1.0
        y.sum().backward()
    return _median_time(chain, repeats, timed) / ops


def in_step_seconds(group, repeats: int, device, timed, calls: int = 20, n: int = 192) -> float:
    """Seconds one small all-reduce in `group` costs between pieces of compute, as inside a training step:
    `calls` rounds of an [n, n] matmul and a 4 KiB all-reduce, less the matmuls alone, per call. Where
    ranks outnumber cores a collective then waits for a peer that is not running, which back-to-back
    collectives (`_axis_times`) do not show."""
    a = torch.randn(n, n, device=device)
    t = torch.zeros(1024, device=device)

    def work(reduce: bool):
        for _ in range(calls):
            a @ a
            if reduce:
                dist.all_reduce(t, group=group)
    both = _median_time(lambda: work(True), repeats, timed, before=lambda: dist.barrier(group=group))
    alone = _median_time(lambda: work(False), repeats, timed, before=lambda: dist.barrier(group=group))
    return max(both - alone, 0.0) / calls


def hidden_share(group, root: int, repeats: int, device, timed, nbytes: int = 1 << 20, n: int = 256) -> float:
    """Of a broadcast of `nbytes` in `group` run beside matmuls, the share they hide: the broadcast alone
    (t_comm), [n, n] matmuls alone, as many as take about as long (t_mm), then the broadcast posted
    asynchronously, the matmuls run and the broadcast waited for (t_both), as SUMMA's double buffering
    runs them. (t_comm + t_mm - t_both) / min(t_comm, t_mm), within [0, 1]: 1 where the transfer runs on
    hardware of its own, 0 where it only runs when the compute does not (cores shared)."""
    t = torch.zeros(nbytes // 4, dtype=torch.float32, device=device)
    a = torch.randn(n, n, device=device)
    before = lambda: dist.barrier(group=group)  # noqa: E731
    comm_s = _median_time(lambda: dist.broadcast(t, src=root, group=group), repeats, timed, before)
    one = _median_time(lambda: a @ a, repeats, timed)
    reps = max(1, round(comm_s / max(one, 1e-9)))
    (reps,) = (int(x) for x in _slowest([float(reps)], device))  # the same count on every rank

    def matmuls():
        for _ in range(reps):
            a @ a

    def both():
        work = dist.broadcast(t, src=root, group=group, async_op=True)
        matmuls()
        work.wait()

    mm_s = _median_time(matmuls, repeats, timed, before)
    both_s = _median_time(both, repeats, timed, before)
    return min(1.0, max(0.0, (comm_s + mm_s - both_s) / min(comm_s, mm_s)))


def check_args(sizes, repeats: int) -> None:
    """UsageError unless every size is a positive multiple of 4 bytes (fp32) and repeats >= 1."""
    bad = [s for s in sizes if not (isinstance(s, int) and s >= 4 and s % 4 == 0)]
    if not sizes or bad:
        raise UsageError(f"calibrate: sizes {list(sizes)}: each must be a positive multiple of 4 bytes "
                         f"(fp32 tensors), e.g. {list(SIZES)}")
    if repeats < 1:
        raise UsageError(f"calibrate: repeats={repeats}: must be >= 1 (5 is the default)")


def measure(grid: tuple[int, int], sizes=SIZES, repeats: int = 5, dtype: str | None = None, shapes=None,
            peak_flops: float | None = None) -> dict:
    """Measure the alpha-beta model of both mesh axes and the matmul rate; call on every rank of an
    initialized default process group of world size R*C. Every rank returns the same dict (times are
    the max over ranks of each rank's median). On CUDA with nccl tensors live on the current device
    and timings synchronize it. The matmul rate is that of `shapes` (the model's products, `model_shapes`;
    default one [1024, 1024] product) in `dtype` (default `default_dtype`); with `peak_flops` (a cluster
    preset's dense peak) also its fraction of it."""
    from passes.mesh import Grid

    check_args(sizes, repeats)
    R, C = grid
    backend = dist.get_backend()
    cuda = torch.cuda.is_available() and backend == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    timed = _timer(torch.cuda.synchronize if cuda else (lambda: None))
    mesh = Grid(R, C, device_type="cuda" if cuda else "cpu")
    axes = []
    for axis in (0, 1):
        if mesh.size(axis) == 1:
            axes.append(unit_axis())
            continue
        local = _axis_times(mesh, axis, sizes, repeats, device, timed)
        worst = _slowest([sec for _, sec in local], device)
        points = [[nbytes, sec] for (nbytes, _), sec in zip(local, worst)]
        alpha, beta = fit_alpha_beta(points)
        axes.append({"alpha_s": alpha, "beta_bytes_per_s": beta, "points": points})
    dtype = dtype or default_dtype(device)
    if dtype not in DTYPES:
        raise UsageError(f"calibrate: dtype {dtype!r}: expected one of {sorted(DTYPES)}")
    shapes = tuple(shapes or ((MATMUL_N,) * 3,))
    mine = [matmul_seconds(repeats, device, timed, dtype=DTYPES[dtype], shape=shape) for shape in shapes]
    rates = matmul_rates(dtype, shapes, _slowest(mine, device), device)  # each shape's slowest rank
    rates["peak_flops"] = peak_flops
    rates["peak_fraction"] = rates["flops_per_s"] / peak_flops if peak_flops else None
    mem_s, mem_bytes = memory_seconds(repeats, device, timed)
    (mem_s, op_s) = _slowest([mem_s, op_seconds(repeats, device, timed)], device)
    # per group size: a collective's cost inside a step (the axes' groups, and all ranks together)
    groups = {mesh.size(a): mesh.group(a) for a in (0, 1) if mesh.size(a) > 1}
    if R * C > max(R, C):
        groups[R * C] = dist.group.WORLD
    sized = {}
    for g, grp in sorted(groups.items()):  # every rank in its own group of that size, then the slowest
        (sized[g],) = _slowest([in_step_seconds(grp, repeats, device, timed)], device)
    # the share of a transfer a matmul beside it hides, on the larger axis's group; the least any rank saw
    axis = 1 if mesh.size(1) >= mesh.size(0) else 0
    hidden = 0.0
    if mesh.size(axis) > 1:
        share = hidden_share(mesh.group(axis), mesh.global_rank(axis, 0), repeats, device, timed)
        hidden = -_slowest([-share], device)[0]
    return {
        "version": VERSION,
        "source": "calibrate",
        "grid": [R, C],
        "backend": backend,
        "device": "cuda" if cuda else "cpu",
        "axes": axes,
        "flops_per_s": rates["flops_per_s"],
        "matmul": rates,  # dtype, TF32, per shape, the preset's peak and the share of it reached
        "memory_bytes_per_s": mem_bytes / mem_s,  # optional keys (autopar.estimate's roofline reads them)
        "op_s": op_s,
        "in_step_alpha_s": {str(g): sec for g, sec in sized.items()},  # group size -> seconds per call
        "hidden": hidden,  # of a transfer beside a matmul, the share hidden (overlap='auto' reads it)
        "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def main_worker(rank: int, grid, out_path, sizes=SIZES, repeats: int = 5, dtype: str | None = None, shapes=None,
                peak_flops: float | None = None) -> dict:
    """One rank of `autopar calibrate`: measure, and on rank 0 save to `out_path` and print a summary.
    Under nccl it first binds this process to its GPU (LOCAL_RANK, as torchrun sets it)."""
    if dist.get_backend() == "nccl" and torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count())))
    model = measure(tuple(grid), tuple(sizes), repeats, dtype, shapes, peak_flops)
    if rank == 0:
        save(model, out_path)
        print(summary(model))
        print(f"wrote {out_path}", flush=True)
    return model
