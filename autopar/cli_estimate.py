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
                                     "name (llama3-8b, llama3-70b, llama3-405b, llama2-13b, llama2-70b, "
                                     "megatron-gpt-1.7b ... megatron-gpt-462b)")
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
            p.add_argument("--cp", type=int, default=1, help="context-parallel ranks each sequence is split over "
                           "(parameters sharded over dp-shard x cp, as torchtitan runs it)")
            p.add_argument("--cp-attention", default="auto", choices=("auto", "alltoall", "ring", "allgather"),
                           help="with --cp: how attention sees every token (default auto: what parallelize's "
                                "context_attention='auto' runs)")
            p.add_argument("--no-overlap", dest="overlap", action="store_false",
                           help="2D and 3D: price every SUMMA transfer in line (parallelize(overlap=False)); "
                                "default: each product's panels after the first beside its matmuls")
            p.add_argument("--keep-after-forward", dest="reshard_after_forward", action="store_false",
                           help="with --dp-shard and no stages: keep each block gathered from its forward to its "
                                "backward (reshard_after_forward=False: one all-gather per block and step, not two)")
            p.add_argument("--shard-optimizer", action="store_true",
                           help="the replicas split the master weights and AdamW states (ZeRO-1, Megatron's "
                                "distributed optimizer)")
            p.add_argument("--pp", type=int, default=1, help="pipeline stages")
            p.add_argument("--schedule", default="1f1b", help="pipeline schedule (1f1b, interleaved_1f1b, gpipe, ...)")
            p.add_argument("--microbatches", type=int, help="micro-batches per step (default: one sequence each)")
            p.add_argument("--interleave", type=int, default=1, help="pipeline stages per rank")
            p.add_argument("--recompute", default="none", choices=("none", "selective", "full"),
                           help="none, selective (per op, torchtitan's) or full (every block)")
            p.add_argument("--recompute-blocks", type=int,
                           help="with --recompute full: recompute only the first K blocks of each stage")
            p.add_argument("--precision", default="bf16-mixed", choices=("bf16-mixed", "bf16", "fp32"),
                           help="bf16-mixed (fp32 master weights, gradients and AdamW states; default), bf16 or "
                                "fp32")
            p.add_argument("--dry-run", nargs="?", const="cover", choices=("cover", "groups", "all"), metavar="RANKS",
                           help="also dry-run the configuration (the whole model on fake tensors, a fake process "
                                "group, one step; autopar.dry_run's rank set: cover (default), groups or all): the "
                                "per-rank table, the cross-rank checks, bytes, calls and memory against the estimate")
            p.add_argument("--workers", type=int, metavar="N",
                           help="with --dry-run: processes that simulate the ranks side by side (default: one per "
                                "CPU; 1: in this process)")
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
                   fp8=ns.fp8, async_tp=ns.async_tp, shard_optimizer=ns.shard_optimizer,
                   recompute_blocks=ns.recompute_blocks, overlap=ns.overlap, cp=ns.cp,
                   cp_attention=ns.cp_attention, reshard_after_forward=ns.reshard_after_forward)
    out = est.to_json()
    if ns.dry_run:
        out["dry_run"] = dry_run_check(est, _model(ns.model), ranks=ns.dry_run, workers=ns.workers)
    if ns.json:
        print(json.dumps(out, indent=1))
    else:
        print(est)
        if ns.dry_run:
            d = out["dry_run"]
            print(f"\ndry run: {d['ranks']} of {d['world']} ranks simulated in {d['seconds']:.1f} s; {d['verdict']}")
            print(d["table"])
            print("per step, one rank of each stage summed (peak: the fullest rank)   dry run         estimate   ratio")
            for kind, v in d["compare"].items():
                ratio = v["dry_run"] / v["estimate"] if v["estimate"] else float(v["dry_run"] == 0)
                print(f"  {kind:<18} {v['dry_run']:>22,.0f} {v['estimate']:>18,.0f}   {ratio:.3f}")
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


def dry_run_check(est, model, ranks=None, workers: int | None = None) -> dict:
    """Dry-run `est`'s configuration -- the whole model (every block, on the meta device), its tensor-parallel
    grid, replicas and pipeline stages, on fake tensors under a fake process group (`autopar.dry_run`, `ranks`
    its rank set, simulated by `workers` processes side by side) -- and set what the simulated ranks moved and
    held beside the estimate: bytes and calls
    per kind summed over one rank of each stage (`passes.cost.step.step_bytes`, at the model's own dtype),
    parameters held, and the most bytes saved for backward on a rank beside the estimate's activations."""
    import time

    from autopar.checkpoint.hf import restore_buffers
    from autopar.parallel.dry_run import dry_run
    from autopar.planning.estimate import boundary, load_model_source, model_profile, tp_bytes
    from autopar.planning.search import parallelize_options
    from passes.cost.step import PRECISIONS, step_bytes

    src, par = load_model_source(model), est.parallel
    tp, dp = par.tp, par.dp_shard * par.dp_replicate
    # what parallelize builds for it (HSDP is not one of its modes: refused)
    options: dict = {**parallelize_options(par), "lowering": "broadcast"}
    grid = options.pop("grid")
    small, inputs = src.build()
    m = src.whole() if src.whole is not None else small
    restore_buffers(m)  # parallelize needs the rotary tables' values
    size = next(p.dtype for p in m.parameters()).itemsize
    t0 = time.perf_counter()
    rep = dry_run(m, grid, example_kwargs=inputs(est.batch // dp, est.seq), ranks=ranks, fake=True, workers=workers,
                  overlap=par.overlap, **options)
    seconds = time.perf_counter() - t0
    prof = model_profile(src, est.seq)[0]
    tb, to = tp_bytes(src, est.seq, tp)
    crossing = boundary(src, est.seq, tp) if par.pp > 1 else None
    expected = step_bytes(prof, src.layers, tb, to, par, est.batch, est.seq, size, size, crossing)
    per_stage: dict = {}  # stage -> its lowest simulated rank's run
    for rank in sorted(rep.ranks):
        per_stage.setdefault(rank * par.pp // rep.world, rep.ranks[rank])
    runs = list(per_stage.values())
    fsdp = sum(r.tags.get("fsdp:all-gather", 0) + r.tags.get("fsdp:reduce-scatter", 0) for r in runs)
    got = {"tp": sum(r.counted["grid"] for r in runs), "tp_calls": sum(r.counted["grid_calls"] for r in runs),
           "fsdp": fsdp, "ddp": sum(r.counted["replicas"] for r in runs) - fsdp,
           "pp": sum(r.counted.get("pp", 0) for r in runs)}
    held_b = PRECISIONS[par.precision][0]
    compare = {k: {"dry_run": got[k], "estimate": expected[k]} for k in got}
    compare["params_per_rank"] = {"dry_run": max(r.held["params"] for r in rep.ranks.values()) // size,
                                  "estimate": est.cost.memory["parameters_and_optimizer"] / held_b}
    compare["saved_bytes_peak"] = {"dry_run": max(r.held["saved"] for r in rep.ranks.values()),
                                   "estimate": est.cost.memory["activations"]}
    # FSDP2 pads each parameter's dim 0 to a multiple of the replicas: its bytes a little above the estimate's
    exact = all(abs(compare[k]["dry_run"] - compare[k]["estimate"]) <= 0.5 for k in ("tp", "tp_calls", "ddp", "pp")) \
        and compare["fsdp"]["estimate"] <= compare["fsdp"]["dry_run"] <= 1.01 * compare["fsdp"]["estimate"]
    return {"ranks": len(rep.ranks), "world": rep.world, "seconds": seconds, "compare": compare,
            "per_rank": {r: {"at": list(run.at), "bytes": run.counted, "calls": len(run.step),
                             "peak_memory_bytes": run.held} for r, run in sorted(rep.ranks.items())},
            "verdict": "cross-rank checks passed; bytes and calls " + ("agree with the estimate" if exact else
                                                                      "DIFFER from the estimate (see compare)"),
            "table": str(rep)}

