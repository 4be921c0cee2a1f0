"""How long `autopar.dry_run` takes, and how much memory, for a Llama-3-70B-shaped model (built on the meta
device: no weights) at 64, 512 and 4,096 ranks, the default rank set ('cover'), one process:

    64      grid 8x8                                  (2D tensor parallelism only)
    512     8 stages x 4 sharded replicas x 4x4       (pipeline, FSDP2, 2D)
    4,096   8 stages x 8 sharded replicas x 8x8

Each configuration runs in a fresh child process so that its peak resident memory is its own. Prints the
simulated ranks, the seconds and the peak RSS per configuration (issue 51's targets: 512 ranks in 60 s,
4,096 in 5 minutes).

    python examples/bench_dry_run.py [--seq 1024] [--layers 80] [--only 512]
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


def one(world: int, seq: int, layers: int) -> dict:
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
    report = autopar.dry_run(model, options["grid"], example_kwargs=dict(input_ids=ids, labels=ids), **kwargs)
    took = time.perf_counter() - t
    return {"world": world, "ranks": len(report.ranks), "seconds": round(took, 1),
            "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=80)
    ap.add_argument("--only", type=int, choices=sorted(CONFIGS), help="one configuration (in this process)")
    ns = ap.parse_args()
    if ns.only:
        print(json.dumps(one(ns.only, ns.seq, ns.layers)))
        return
    print(f"Llama-3-70B shape on meta, {ns.layers} blocks, sequences of {ns.seq}; autopar.dry_run, default rank set")
    print(f"{'world':>6} {'layout':<42} {'ranks':>5} {'seconds':>8} {'peak RSS':>9}")
    for world, options in CONFIGS.items():
        out = subprocess.run([sys.executable, __file__, "--only", str(world), "--seq", str(ns.seq), "--layers",
                              str(ns.layers)], capture_output=True, text=True)
        if out.returncode:
            print(f"{world:>6} failed:\n{out.stderr[-2000:]}")
            continue
        r = json.loads(out.stdout.strip().splitlines()[-1])
        layout = " x ".join(f"{k} {v}" for k, v in options.items())
        print(f"{world:>6} {layout:<42} {r['ranks']:>5} {r['seconds']:>8.1f} {r['peak_rss_gib']:>7.2f} GB")


if __name__ == "__main__":
    main()
