"""How long `autopar.dry_run` takes, and how much memory, for a Llama-3-70B-shaped model (built on the meta
device: no weights) at 64, 512 and 4,096 ranks, the default rank set ('cover'), one process:

    64      grid 8x8                                  (2D tensor parallelism only)
    512     8 stages x 4 sharded replicas x 4x4       (pipeline, FSDP2, 2D)
    4,096   8 stages x 8 sharded replicas x 8x8

Each configuration runs in a fresh child process so that its peak resident memory is its own. Prints the
simulated ranks, the worker processes simulating them side by side (default: one per CPU), the seconds,
and the peak RSS of the main process and of its largest worker per configuration (issue 51's targets:
512 ranks in 60 s, 4,096 in 5 minutes).

    python examples/bench_dry_run.py [--seq 1024] [--layers 80] [--only 512] [--workers 1]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

CONFIGS = {64: dict(grid=(8, 8)),
           512: dict(grid=(4, 4, 4), pipeline=8, data_parallel="shard"),
           4096: dict(grid=(8, 8, 8), pipeline=8, data_parallel="shard")}


def one(world: int, seq: int, layers: int, workers: int | None = None) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import autopar

    cfg = LlamaConfig(hidden_size=8192, intermediate_size=28672, num_attention_heads=64, num_key_value_heads=8,
                      num_hidden_layers=layers, vocab_size=128256, max_position_embeddings=seq,
                      tie_word_embeddings=False)
    from autopar.checkpoint.hf import restore_buffers

    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    restore_buffers(model)  # the rotary table's values, which parallelize needs
    options = CONFIGS[world]
    rows = options["grid"][-2]
    pipeline = options.get("pipeline")
    # one sequence per grid row and micro-batch; a pipeline runs as many micro-batches as it has stages
    replicas = options["grid"][0] if len(options["grid"]) == 3 else 1
    batch = rows * replicas * (pipeline or 1)
    ids = torch.zeros(batch, seq, dtype=torch.long)  # real: the dry run makes fake tensors of them
    kwargs = dict(pipeline=autopar.Pipeline(stages=pipeline, schedule="1f1b", microbatches=pipeline)
                  if pipeline else None, **{k: v for k, v in options.items() if k not in ("grid", "pipeline")})
    t = time.perf_counter()
    report = autopar.dry_run(model, options["grid"], example_kwargs=dict(input_ids=ids, labels=ids), workers=workers,
                             **kwargs)
    took = time.perf_counter() - t
    peak = [resource.getrusage(who).ru_maxrss / 2**20 for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    return {"world": world, "ranks": len(report.ranks), "seconds": round(took, 1), "workers": workers,
            "peak_rss_gib": round(peak[0], 2), "worker_peak_rss_gib": round(peak[1], 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=80)
    ap.add_argument("--only", type=int, choices=sorted(CONFIGS), help="one configuration (in this process)")
    ap.add_argument("--workers", type=int, help="processes simulating ranks side by side (default: one per CPU)")
    ap.add_argument("--baseline", action="store_true", help="each configuration with one worker too, and the ratio")
    ns = ap.parse_args()
    if ns.only:
        print(json.dumps(one(ns.only, ns.seq, ns.layers, ns.workers)))
        return
    print(f"Llama-3-70B shape on meta, {ns.layers} blocks, sequences of {ns.seq}; autopar.dry_run, default rank set")
    print(f"{'world':>6}  {'layout':<46} {'ranks':>5} {'workers':>7} {'seconds':>8} {'peak RSS: main + worker':>24}")
    for world, options in CONFIGS.items():
        layout = " x ".join(f"{v}" if k == "grid" else f"{k} {v}" for k, v in options.items())
        first = None
        for workers in ([1] if ns.baseline else []) + [ns.workers]:
            more = ["--workers", str(workers)] if workers else []
            out = subprocess.run([sys.executable, __file__, "--only", str(world), "--seq", str(ns.seq), "--layers",
                                  str(ns.layers), *more], capture_output=True, text=True)
            if out.returncode:
                print(f"{world:>6} failed:\n{out.stderr[-2000:]}")
                break
            r = json.loads(out.stdout.strip().splitlines()[-1])
            ratio = f"  {r['seconds'] / first:.2f}x of one worker" if first else ""
            first = first or r["seconds"]
            print(f"{world:>6}  {layout:<46} {r['ranks']:>5} {r['workers'] or 'CPUs':>7} {r['seconds']:>8.1f} "
                  f"{r['peak_rss_gib']:>12.2f} + {r['worker_peak_rss_gib']:.2f} GB{ratio}")


if __name__ == "__main__":
    main()
