"""Benchmark: planning real-size models at 8x8 on this one CPU process (no ranks, nothing allocated).

GPT-2-XL (48 layers, hidden 1600, 25 heads, vocab 50257) and a Llama-7B shape (32 layers, hidden
4096, intermediate 11008, 32 heads, vocab 32000), batch 8, sequence 1024: wall time and peak RSS of
`autopar.plan` (each in a fresh process), its headline numbers against 1D at p=64, and how the time
grows with the number of layers (GPT-2-XL shape at 12 / 24 / 48 layers).
"""

import json
import os
import resource
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MODELS = {
    "gpt2-xl": ("GPT2Config", "GPT2LMHeadModel", dict(n_layer=48, n_embd=1600, n_head=25, vocab_size=50257,
                                                     n_positions=1024)),
    "llama-7b": ("LlamaConfig", "LlamaForCausalLM", dict(num_hidden_layers=32, hidden_size=4096,
                                                        intermediate_size=11008, num_attention_heads=32,
                                                        num_key_value_heads=32, vocab_size=32000)),
}


def one(name, layers=None):
    import torch
    import transformers

    import autopar

    cfg_cls, model_cls, kw = MODELS[name]
    if layers:
        kw = dict(kw, n_layer=layers)
    t0 = time.perf_counter()
    with autopar.meta_init():
        model = getattr(transformers, model_cls)(getattr(transformers, cfg_cls)(**kw))
    ids = torch.zeros(8, 1024, dtype=torch.long)
    pl = autopar.plan(model, grid=(8, 8), example_kwargs=dict(input_ids=ids, labels=ids))
    seconds = time.perf_counter() - t0
    j = pl.to_json()
    hidden = kw.get("n_embd") or kw["hidden_size"]
    nl = kw.get("n_layer") or kw["num_hidden_layers"]
    one_d = autopar.compare_1d(pl, model, 8 * 1024, nl, hidden)
    print(json.dumps({"seconds": seconds, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                      "comm_gib": j["comm_bytes_per_rank_per_step"] / 2**30,
                      "comm_1d_gib": one_d["comm_bytes_per_rank_per_step"] / 2**30,
                      "param_gib": j["param_bytes_per_rank"] / 2**30, "param_total_over_64_gib":
                      j["param_bytes_total"] / 64 / 2**30, "activation_gib": j["activation_bytes_per_rank"] / 2**30,
                      "costly_fallbacks": [f["node"] for f in j["fallback_nodes"] if f["costly"]],
                      "above_1_over_p": list(j["params_above_1_over_p"])[:3]}))


def run(name, layers=None):
    args = [sys.executable, os.path.abspath(__file__), "--one", name] + ([str(layers)] if layers else [])
    out = subprocess.run(args, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main():
    print("autopar.plan at 8x8, batch 8, sequence 1024, one CPU process (goal: < 30 s and < 2 GB each)")
    for name in MODELS:
        r = run(name)
        print(f"  {name:9s} {r['seconds']:5.1f} s  peak RSS {r['peak_rss_mb']:5.0f} MB  | per rank per step: "
              f"2D {r['comm_gib']:.2f} GiB vs 1D {r['comm_1d_gib']:.2f} GiB received "
              f"(2D/1D {r['comm_gib'] / r['comm_1d_gib']:.2f}); "
              f"parameters {r['param_gib']:.3f} GiB (model/64 = {r['param_total_over_64_gib']:.3f}); saved for "
              f"backward {r['activation_gib']:.2f} GiB; costly fallbacks {r['costly_fallbacks'] or 'none'}")
    print("planning time against layer count (GPT-2-XL shape):")
    base = None
    for layers in (12, 24, 48):
        r = run("gpt2-xl", layers)
        base = base or r["seconds"]
        print(f"  {layers:2d} layers: {r['seconds']:5.1f} s ({r['seconds'] / base:.2f}x the 12-layer time)")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--one":
        one(sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else None)
    else:
        main()
