"""`choose_plan`: the fastest parallel configuration of a training step that fits, among what
`parallelize` builds, from one capture pair of the model.

The candidates for `devices` GPUs of a cluster with G GPUs per node:

    tensor parallel   none; 1D over t (a power of two up to G, dividing the attention heads); 2D R x C
                      SUMMA with R * C up to 4G (crossing nodes where the model says it pays); the
                      q x q x q cube where it divides the devices
    pipeline          S stages dividing what TP leaves (S = 1 included: pure FSDP, FSDP x TP), at most
                      the blocks; schedules '1f1b' and 'interleaved_1f1b' (2 or 4 stages per rank); M
                      micro-batches: S, 2S, 4S ... up to the local batch (one sequence each)
    replicas          the rest, sharded (FSDP2; without stages each block released after its forward or
                      kept gathered to its backward) or replicated
    context parallel  or the rest as cp ranks over which each sequence is split times dp_shard replicas beside
                      them (no stages, the blocks sharded over all: `parallelize(grid=(dp, R, C),
                      context_parallel=cp, data_parallel='shard')`), where 2 cp divides the sequence; attention
                      by all-to-all where the heads divide by cp, else by the ring
    recompute         none, selective (per op) or full (every block); where keeping every activation does
                      not fit and recomputing every block does, the first k blocks of each stage, the
                      fewest that fit

Each is priced by `autopar.estimate` (`passes.cost.step`); those whose memory per GPU exceeds the
limit (the cluster's memory unless given) are dropped; the fastest remains. Captures are shared: the
model's profile once per sequence length, each tensor-parallel layout's bytes once, so the search
costs a few captures plus microseconds per candidate.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass

from autopar.errors import MemoryLimitError, UsageError
from autopar.planning.estimate import Estimate, estimate, head_columns, load_model_source
from autopar.program.spec import spec_of_dimensions
from passes.cost.cluster import resolve_cluster
from passes.options import Options, format_bytes

__all__ = ["TrainingPlan", "choose_plan", "parallelize_options", "tp_layouts"]

RECOMPUTE_KWARG = {"none": False, "selective": "selective", "full": "blocks"}  # estimate's -> parallelize's
INTERLEAVE = (2, 4)  # stages per rank the interleaved schedule is searched with (Megatron runs 2-4 at scale)


def _divisors(n: int) -> list:
    return [d for d in range(1, n + 1) if n % d == 0]


def tp_layouts(devices: int, gpus_per_node: int, heads: int | None, kv_heads: int | None) -> list:
    """The tensor-parallel layouts searched (see the module docstring)."""
    out: list = [(1,)]
    t = 2
    while t <= min(gpus_per_node, devices):
        if devices % t == 0 and (not heads or heads % t == 0):
            out.append((t,))
        t *= 2
    for p in _divisors(devices):
        if 4 <= p <= 4 * gpus_per_node:
            out += [(r, p // r) for r in _divisors(p) if 2 <= r <= p // r and (not heads or heads % (p // r) == 0)]
    q = round(devices ** (1 / 3))
    for s in (q - 1, q, q + 1):  # the cube takes every device (parallelize runs it without replicas or stages)
        if s >= 2 and s ** 3 == devices and (not heads or heads % (s * s) == 0):
            out.append((s, s, s))
    return list(dict.fromkeys(out))


@dataclass
class TrainingPlan:
    """The configuration chosen and every candidate's estimate (`table`, fastest first)."""

    best: Estimate
    table: list  # Estimate per candidate that fits, fastest first
    refused: int  # candidates that did not fit the memory limit
    search_s: float
    cannot_run: int = 0  # combinations `estimate` refused (a schedule's micro-batch rule, rows without whole sequences)

    @property
    def kwargs(self) -> dict:
        """What to pass `autopar.parallelize` for this configuration."""
        p = self.best.parallel
        out = parallelize_options(p)
        if len(p.tp) > 1:
            out["lowering"] = "broadcast"  # what the estimate prices (its broadcasts overlap the products)
        if p.cp > 1:  # the sequence over the cp ranks, the grid's blocks sharded over them (as priced)
            out.update(context_parallel=p.cp, context_attention=p.cp_attention, data_parallel="shard")
        return out

    def __str__(self) -> str:
        lines = [str(self.best), f"  ({len(self.table)} configurations fit, {self.refused} did not, {self.cannot_run} "
                 f"cannot run; searched in {self.search_s:.1f} s)", "  next fastest:"]
        for e in self.table[1:6]:
            lines.append(f"    {e.tokens_per_s_per_gpu:9,.0f} tok/s/GPU  {e.memory_gib_per_rank:6.1f} GiB  "
                         f"{e.parallel.describe()}")
        return "\n".join(lines)


def parallelize_options(p) -> dict:
    """`parallelize`'s arrangement, recomputation and FSDP2 gathering for estimate dimensions `p`
    (`passes.cost.step.Parallel`; `spec_of_dimensions` refuses what it does not build), as priced."""
    out = {**spec_of_dimensions(p).kwargs(), "recompute": RECOMPUTE_KWARG[p.recompute]}
    if p.recompute == "full" and p.recompute_blocks is not None:
        out["recompute_blocks"] = p.recompute_blocks
    if p.dp_shard > 1 and (p.pp > 1 or not p.reshard_after_forward):  # kept gathered, as priced (a stage
        out["reshard_after_forward"] = False  # through its micro-batches; a block from forward to backward)
    return out


def _microbatches(local: int, stages: int) -> list:
    out, m = [], stages
    while m <= local:
        if local % m == 0:
            out.append(m)
        m *= 2
    if local >= stages and local not in out:
        out.append(local)
    return out


def _candidates(layouts, devices: int, batch: int, layers: int, max_stages: int, schedules, data_parallel,
                recompute, seq: int, heads: tuple = (1, 1)):
    """`estimate`'s keywords for every candidate of the module docstring."""
    for layout in layouts:
        t = math.prod(layout)
        if devices % t:
            continue
        cube = len(layout) == 3  # takes every device: no stages, no replicas
        for pp in _divisors(devices // t) if not cube else (1,):
            dp = devices // (t * pp)
            if pp > min(layers, max_stages) or batch % dp or (cube and dp > 1):
                continue
            pipes = [("1f1b", 1, 1)] if pp == 1 else \
                [(s, v, m) for s in schedules for v in (INTERLEAVE if s == "interleaved_1f1b" else (1,))
                 for m in _microbatches(batch // dp, pp) if not (v > 1 and v * pp > layers)]
            # sharded replicas without stages: each block released after its forward, or kept to its backward
            kinds = [(k, True) for k in (data_parallel if dp > 1 else ("shard",))]
            kinds += [("shard", False)] if ("shard", True) in kinds and dp > 1 and pp == 1 else []
            for (kind, release), (sched, v, m), rc in itertools.product(kinds, pipes, recompute):
                yield dict(tp=layout, dp_shard=dp if kind == "shard" else 1, dp_replicate=1 if kind == "shard" else dp,
                           pp=pp, schedule=sched, microbatches=m, interleave=v, recompute=rc,
                           reshard_after_forward=release)
        # context parallel over cp of the devices the grid leaves, dp_shard = the rest, the blocks sharded over both:
        # what parallelize builds (grid=(dp, R, C), context_parallel=cp, data_parallel='shard'; no stages)
        for cp in _divisors(devices // t) if not cube else ():
            dp = devices // (t * cp)
            if cp == 1 or seq % (2 * cp) or batch % dp:
                continue
            # the all-to-all where this rank's query and KV heads divide by cp, else the ring (whose unfused block
            # products never beat the all-to-all's fused attention where both run)
            mine = [n // head_columns(layout) for n in heads]
            flavour = "alltoall" if all(n and n % cp == 0 for n in mine) else "ring"
            for rc in recompute:
                yield dict(tp=layout, dp_shard=dp, dp_replicate=1, pp=1, schedule="1f1b", microbatches=1, interleave=1,
                           recompute=rc, cp=cp, cp_attention=flavour)


def _partial(kw: dict, none: Estimate, full: Estimate, limit: float, layers: int, priced) -> None:
    """Recompute the first k blocks of each stage, the fewest whose memory fits `limit`: memory falls about
    linearly in k from `none`'s to `full`'s (the last block's recomputation saves nothing at the peak), so
    k starts where the line crosses the limit and grows until the estimate fits (each tried estimate goes
    to `priced`)."""
    per_stage = math.ceil(layers / (kw["pp"] * kw["interleave"]))
    over, span = none.cost.memory_bytes - limit, none.cost.memory_bytes - full.cost.memory_bytes
    k = min(per_stage - 1, max(1, math.ceil(per_stage * over / span)))  # all but the last rebuilt one holds less
    while k < per_stage:
        est = priced({**kw, "recompute": "full", "recompute_blocks": k})
        if est is None or est.cost.memory_bytes <= limit:
            return
        k += 1


def choose_plan(model, *, devices: int, cluster="dgx-h100", global_batch: int, seq: int, memory_limit=None,
                recompute=("none", "selective", "full"), schedules=("1f1b", "interleaved_1f1b"),
                data_parallel=("shard", "replicate"), tp=None, max_stages: int = 32, compile: bool = False,
                fp8: bool = False, async_tp: bool = False) -> TrainingPlan:
    """The fastest configuration of a step of `global_batch` sequences of `seq` tokens on `devices` GPUs of
    `cluster` whose estimated memory per GPU fits `memory_limit` (bytes or '70GiB'; None: the cluster's
    memory), among the candidates of the module docstring (`tp`: a list of layouts to restrict them).
    `compile`, `fp8` and `async_tp` are taken as given (techniques, not searched). Raises a
    MemoryLimitError naming the smallest footprint when nothing fits."""
    t0 = time.perf_counter()
    batch = global_batch
    cl = resolve_cluster(cluster)
    if cl is None:
        raise UsageError("autopar.choose_plan: cluster=None: name a preset or pass a Cluster")
    if not isinstance(devices, int) or devices < 1:
        raise UsageError(f"autopar.choose_plan: devices={devices!r}: expected a positive int")
    limit = Options(memory_limit=memory_limit).memory_limit_bytes if memory_limit is not None else cl.memory_bytes
    src = load_model_source(model)
    layouts = [tuple(t) if not isinstance(t, int) else (t,) for t in tp] if tp is not None else \
        tp_layouts(devices, cl.gpus_per_node, src.heads, src.kv_heads)
    fits, refused, smallest, cannot = [], 0, None, 0
    ends: dict = {}  # a configuration -> its estimates with recompute 'none' and 'full'

    def priced(kw):
        nonlocal smallest, refused, cannot
        try:
            est = estimate(src, devices=devices, cluster=cl, global_batch=batch, seq=seq, compile=compile, fp8=fp8,
                           async_tp=async_tp, **kw)
        except UsageError:  # a combination parallelize refuses too: counted, not priced
            cannot += 1
            return None
        if smallest is None or est.cost.memory_bytes < smallest.cost.memory_bytes:
            smallest = est
        if est.cost.memory_bytes <= limit:
            fits.append(est)
        else:
            refused += 1
        return est

    heads = (src.heads or 1, src.kv_heads or src.heads or 1)
    for kw in _candidates(layouts, devices, batch, src.layers, max_stages, schedules, data_parallel, recompute, seq,
                          heads):
        est = priced(kw)
        if est is not None and kw["recompute"] in ("none", "full"):
            ends.setdefault(tuple((k, v) for k, v in kw.items() if k != "recompute"), {})[kw["recompute"]] = est
    for key, by in ends.items():  # keeping every activation does not fit, recomputing every block does
        if len(by) == 2 and by["none"].cost.memory_bytes > limit >= by["full"].cost.memory_bytes:
            _partial(dict(key), by["none"], by["full"], limit, src.layers, priced)
    if not fits:
        where = f"; the smallest is {format_bytes(smallest.cost.memory_bytes)} with {smallest.parallel.describe()}" \
            if smallest else ""
        raise MemoryLimitError(f"autopar.choose_plan: no configuration of {devices} GPUs fits "
                               f"{format_bytes(limit)} per GPU{where}. Use more GPUs, a smaller batch or a shorter "
                               f"sequence")
    fits.sort(key=lambda e: (-e.tokens_per_s_per_gpu, e.cost.memory_bytes))
    return TrainingPlan(fits[0], fits, refused, time.perf_counter() - t0, cannot)
