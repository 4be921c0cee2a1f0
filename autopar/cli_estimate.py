"""`autopar estimate` and `autopar plan`: a training configuration's estimated step, and the fastest
configuration that fits, for a transformers `config.json` (built on the meta device: no weights).

    python -m autopar estimate config.json --devices 256 --cluster grand-teton-h100 --batch 16 --seq 8192 \\
        --tp 8 --dp-shard 32 --recompute full --json
    python -m autopar plan config.json --devices 512 --cluster dgx-h100 --global-batch 1024 --seq 8192

MODEL is the path of a config.json (or of the folder holding one), or the name of a published
architecture (`autopar.bench.published.MODELS`: llama3-8b, llama3-70b, llama3-405b, ...).
"""

from __future__ import annotations

import json
import sys


def add_arguments(sub) -> None:
    """The two commands' flags (no torch import: `--help` stays quick)."""
    for name, help_ in (("estimate", "estimate one training configuration's step time, throughput and memory"),
                        ("plan", "search the fastest training configuration that fits (stages, replicas, TP, "
                                 "recompute)")):
        p = sub.add_parser(name, help=help_)
        p.add_argument("model", help="a transformers config.json (or its folder), or a published architecture's "
                                     "name (llama3-8b, llama3-70b, llama3-405b, llama2-13b, llama2-70b)")
        p.add_argument("--devices", type=int, required=True, help="GPUs in all")
        p.add_argument("--cluster", default="dgx-h100", help="a cluster preset: dgx-h100 (default), "
                                                             "grand-teton-h100, dgx-a100")
        p.add_argument("--seq", type=int, required=True, help="tokens per sequence")
        p.add_argument("--json", action="store_true", help="print one JSON object")
        p.add_argument("--compile", action="store_true", help="price the step under torch.compile (fused "
                                                              "memory-bound ops)")
        p.add_argument("--fp8", action="store_true", help="price the linears' GEMMs in FP8")
        p.add_argument("--async-tp", action="store_true", help="price 1D TP's collectives overlapped with their "
                                                               "matmuls")
        if name == "estimate":
            p.add_argument("--batch", type=int, help="sequences per data-parallel rank (torchtitan's local batch)")
            p.add_argument("--global-batch", type=int, help="sequences per step in all (instead of --batch)")
            p.add_argument("--tp", default="1", help="tensor parallel: t (1D), R,C (2D SUMMA) or q,q,q (3D)")
            p.add_argument("--dp-shard", type=int, help="FSDP2 ranks (default: what the devices leave)")
            p.add_argument("--dp-replicate", type=int, default=1, help="replicas (HSDP with --dp-shard)")
            p.add_argument("--pp", type=int, default=1, help="pipeline stages")
            p.add_argument("--schedule", default="1f1b", help="pipeline schedule (1f1b, interleaved_1f1b, gpipe, ...)")
            p.add_argument("--microbatches", type=int, help="micro-batches per step (default: one sequence each)")
            p.add_argument("--interleave", type=int, default=1, help="pipeline stages per rank")
            p.add_argument("--recompute", default="none", choices=("none", "selective", "full"),
                           help="none, selective (per op, torchtitan's) or full (every block)")
            p.add_argument("--precision", default="bf16-mixed", choices=("bf16-mixed", "bf16", "fp32"),
                           help="bf16-mixed (fp32 master weights, gradients and AdamW states; default), bf16 or "
                                "fp32")
            p.add_argument("--dry-run", action="store_true", help="also dry-run the configuration's tensor-parallel "
                           "program on a fake process group (its stage on its grid, one step): bytes and calls per "
                           "rank against the estimate")
        else:
            p.add_argument("--global-batch", type=int, required=True, help="sequences per step in all")
            p.add_argument("--memory-limit", help="per GPU, e.g. 70GiB (default: the cluster's memory)")


def _model(name: str):
    import os

    from autopar.planning.architectures import MODELS, published_model

    if not os.path.exists(name) and name in MODELS:
        return published_model(name)
    return name


def run(ns) -> int:
    from autopar.errors import UsageError

    try:
        return _estimate(ns) if ns.cmd == "estimate" else _plan(ns)
    except UsageError as e:
        print(str(e).replace("autopar.estimate:", f"autopar {ns.cmd}:", 1), file=sys.stderr)
        return 2


def _estimate(ns) -> int:
    from autopar.planning.estimate import estimate

    est = estimate(_model(ns.model), devices=ns.devices, cluster=ns.cluster, seq=ns.seq, batch=ns.batch,
                   global_batch=ns.global_batch, tp=ns.tp, dp_shard=ns.dp_shard,
                   dp_replicate=ns.dp_replicate, pp=ns.pp, schedule=ns.schedule, microbatches=ns.microbatches,
                   interleave=ns.interleave, recompute=ns.recompute, precision=ns.precision, compile=ns.compile,
                   fp8=ns.fp8, async_tp=ns.async_tp)
    out = est.to_json()
    if ns.dry_run:
        out["dry_run"] = dry_run_check(est, _model(ns.model))
    if ns.json:
        print(json.dumps(out, indent=1))
    else:
        print(est)
        if ns.dry_run:
            d = out["dry_run"]
            print(f"  dry run of one stage's tensor-parallel program ({d['ranks']} ranks simulated, "
                  f"{d['seconds']:.1f} s): {d['verdict']}; bytes per rank {d['bytes']:,} (estimate "
                  f"{d['estimated_bytes']:,.0f}), calls {d['calls']} (estimate {d['estimated_calls']})")
    return 0


def _plan(ns) -> int:
    from autopar.planning.search import choose_plan

    plan = choose_plan(_model(ns.model), devices=ns.devices, cluster=ns.cluster, global_batch=ns.global_batch,
                       seq=ns.seq, memory_limit=ns.memory_limit, compile=ns.compile, fp8=ns.fp8,
                       async_tp=ns.async_tp)
    if ns.json:
        kwargs = {k: (repr(v) if k == "pipeline" else v) for k, v in plan.kwargs.items()}
        print(json.dumps({"best": plan.best.to_json(), "parallelize": kwargs, "search_s": plan.search_s,
                          "fits": len(plan.table), "refused": plan.refused,
                          "next": [e.to_json() for e in plan.table[1:10]]}, indent=1))
    else:
        print(plan)
        print(f"  autopar.parallelize(model, **{plan.kwargs})")
    return 0


def dry_run_check(est, model) -> dict:
    """Dry-run `est`'s tensor-parallel program (the model at its captured depth, a sequence per grid row, on a fake
    process group: `autopar.dry_run`) and compare each simulated rank's bytes with the estimate's."""
    import time

    from autopar.checkpoint.hf import restore_buffers
    from autopar.parallel.dry_run import dry_run
    from autopar.planning.estimate import load_model_source, model_profile, rows, tp_bytes

    src = load_model_source(model)
    tp = est.parallel.tp
    grid, strategy = ((1, tp[0]), "1d") if len(tp) == 1 else (tuple(tp), "2d" if len(tp) == 2 else "3d")
    m, inputs = src.build()
    restore_buffers(m)  # parallelize needs the rotary tables' values
    t0 = time.perf_counter()
    n = rows(tp)  # sequences: whole ones on every row of the grid
    rep = dry_run(m, grid, example_kwargs=inputs(n, est.seq), strategy=strategy, fake=True, lowering="broadcast")
    prof = model_profile(src, est.seq)[0]
    tb, to = tp_bytes(src, est.seq, tp)
    expected = sum(prof.blocks * b + o for b, o in zip(tb.bytes(n), to.bytes(n)))
    calls = sum(prof.blocks * b + o for b, o in zip(tb.calls, to.calls))
    counted = {r: run.counted.get("grid", 0) for r, run in rep.ranks.items()}
    worst = max(counted.values())
    return {"ranks": len(rep.ranks), "seconds": time.perf_counter() - t0, "bytes": worst,
            "estimated_bytes": expected, "calls": max(len(run.step) for run in rep.ranks.values()),
            "estimated_calls": calls, "per_rank_bytes": counted,
            "verdict": "cross-rank checks passed; bytes " + ("agree" if abs(worst - expected) <= 1e-6 * max(1, expected)
                                                             else "DIFFER")}
