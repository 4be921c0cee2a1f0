"""`autopar inspect`'s modes beyond one grid's plan: a pipeline's plan (`--pipeline S`), the pipeline
search (`--pipeline auto`) and the dry run (`--dry-run`). `autopar.cli` parses the arguments and
builds the model; each function here prints its report and returns the exit status."""

from __future__ import annotations

import json

__all__ = ["choose_pipeline_cmd", "dry_run_cmd", "pipeline_cmd"]


def pipeline_cmd(ns, model, grid, args, kwargs, strategy, limit) -> int:
    """inspect --pipeline S: the pipeline's plan (per stage and pipeline rank, bubble, step estimate)."""
    import autopar

    pipe = autopar.Pipeline(stages=ns.pipeline, schedule=ns.schedule, microbatches=ns.microbatches,
                            stages_per_rank=ns.stages_per_rank)
    pl = autopar.plan(model, grid=grid, example_inputs=args, example_kwargs=kwargs, strategy=strategy,
                      cost_model=ns.cost_model, memory_limit=limit, recompute=ns.recompute,
                      data_parallel=ns.data_parallel, pipeline=pipe, cluster=ns.cluster)
    print(json.dumps(pl.to_json(), indent=2, default=str) if ns.json else pl)
    return 0

def dry_run_cmd(ns, model, grid, args, kwargs, strategy, limit) -> int:
    """inspect --dry-run: `autopar.dry_run`'s per-rank table and the checks' verdict (exit status 1 when a
    check fails)."""
    import autopar
    from autopar.parallel.dry_run import DryRunError

    if isinstance(grid, int):
        raise SystemExit("autopar inspect --dry-run: needs a grid (RxC, DxRxC), not a device count")
    if ":" not in ns.model:  # built on the meta device: its rotary tables and position ids recomputed
        from autopar.checkpoint import restore_buffers

        restore_buffers(model)
    ranks = "cover" if ns.dry_run == "covering" else ns.dry_run  # 'covering': this option's earlier name
    report = autopar.dry_run(model, grid=grid, example_inputs=args, example_kwargs=kwargs, ranks=ranks, check=False,
                             strategy=strategy, memory_limit=limit, recompute=ns.recompute,
                             data_parallel=ns.data_parallel, reshard_after_forward=ns.reshard_after_forward,
                             workers=ns.workers)
    try:
        report.check()
        verdict = "passed: every simulated member of each group issues the same collectives"
    except DryRunError as e:
        verdict = f"FAILED: {e}"
    if ns.json:
        print(json.dumps({**report.to_json(), "checks": verdict}, indent=2, default=str))
    else:
        print(f"{report}\nchecks {verdict}")
    return 0 if verdict.startswith("passed") else 1

def choose_pipeline_cmd(ns, model, kwargs, limit, args) -> int:
    """inspect --pipeline auto --devices N: `autopar.choose_pipeline`'s table and choice."""
    import autopar
    from passes.options import format_bytes

    if not ns.devices or args:
        raise SystemExit("autopar inspect --pipeline auto: needs --devices N and a model called with keyword inputs "
                         "(a transformers model type, or a module:callable returning kwargs)")
    best, table = autopar.choose_pipeline(model, ns.devices, kwargs, cluster=ns.cluster or "dgx-h100",
                                          memory_limit=limit)
    if ns.json:
        print(json.dumps({"chosen": best.to_json(), "tried": table}, indent=2, default=str))
        return 0
    for row in sorted(table, key=lambda r: r["step_s"]):
        print(f"{row['stages']} stages x {row['d']} replica(s) ({row['data_parallel']}) x grid "
              f"{row['grid'][0]}x{row['grid'][1]}, {row['schedule']}, {row['microbatches']} micro-batches, recompute "
              f"{row['recompute']}: step {row['step_s'] * 1e3:.1f} ms, bubble {row['bubble']:.0%}, "
              f"{format_bytes(row['memory_bytes'])}/rank" + ("" if row["fits"] else " (does not fit)"))
    print(f"\nchosen:\n{best}")
    return 0
