"""Benchmark: planning mixture-of-experts models at 8x8 on one CPU process (nothing allocated).

A Mixtral-8x7B shape (32 layers, hidden 4096, 8 experts of intermediate 14336, top-2, 32 heads, 8 KV
heads, vocab 32000) and the DeepSeek-V3 shape (61 layers, hidden 7168, 256 routed experts of
intermediate 2048 plus one shared, top-8, latent attention; --layers plans fewer), batch 8, sequence 1024:
parameters per rank against 1/p, bytes received per rank per step, memory, and the wall time of
`autopar.plan` -- also for 8, 64 and 256 experts at a fixed layer count, to see how planning time
grows with the graph.

    .venv/bin/python examples/bench_moe_plan.py                # all rows, JSON lines
    .venv/bin/python examples/bench_moe_plan.py --only mixtral --layers 4
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MIXTRAL = ("MixtralConfig", "MixtralForCausalLM",
           dict(num_hidden_layers=32, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2, vocab_size=32000))
DEEPSEEK = ("DeepseekV3Config", "DeepseekV3ForCausalLM",
            dict(num_hidden_layers=61, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
                 num_attention_heads=128, num_key_value_heads=128, n_routed_experts=256, n_shared_experts=1,
                 num_experts_per_tok=8, n_group=8, topk_group=4, first_k_dense_replace=3, vocab_size=129280,
                 kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128))
MODELS = {"mixtral-8x7b": MIXTRAL, "deepseek-v3": DEEPSEEK}


def plan_one(name: str, layers: int | None, experts: int | None, fused: str = "regroup", grid=(8, 8), batch=8,
             seq=1024, activations: bool = False, dispatch: str = "auto") -> dict:
    import torch
    import transformers

    import autopar

    cfg_name, model_name, kw = MODELS[name]
    kw = dict(kw, use_cache=False)
    if layers:
        kw["num_hidden_layers"] = layers
    if experts:
        kw["num_local_experts" if name.startswith("mixtral") else "n_routed_experts"] = experts
        if not name.startswith("mixtral"):
            kw.update(n_group=min(8, experts), topk_group=min(4, experts))
    with autopar.meta_init():
        model = getattr(transformers, model_name)(getattr(transformers, cfg_name)(**kw))
    ids = torch.zeros(batch, seq, dtype=torch.long)
    t0 = time.perf_counter()
    # activations: rank (0, 0)'s graph run on fake tensors (minutes for the whole models), off unless asked
    pl = autopar.plan(model, grid=grid, example_kwargs=dict(input_ids=ids, labels=ids),
                      measure_activations=activations, fused=fused, moe_dispatch=dispatch)
    seconds = time.perf_counter() - t0
    p = grid[0] * grid[1]
    return {"model": name, "layers": kw["num_hidden_layers"], "experts": experts or "default", "fused": fused,
            "dispatch": dispatch, "grid": list(grid),
            "params_total": pl.param_bytes_total // 4, "params_per_rank_x_1_over_p":
            round(pl.param_bytes_per_rank * p / pl.param_bytes_total, 4),
            "comm_bytes_per_rank_per_step": pl.comm_bytes_per_rank_per_step,
            "param_grad_adam_bytes_per_rank": 4 * pl.param_bytes_per_rank, "plan_seconds": round(seconds, 1),
            "gathered": sorted({str(f.node.target) for f in pl.fallbacks if f.costly}),
            "plan_rows": len(pl.rows), "activation_bytes_per_rank": pl.activation_bytes}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=sorted(MODELS), help="one model")
    ap.add_argument("--layers", type=int, help="layers (default: the model's)")
    ap.add_argument("--experts", type=int, nargs="*", help="expert counts to time (default: the model's)")
    ap.add_argument("--fused", choices=("regroup", "interleave"), default="regroup",
                    help="how the interleaved gate|up weights are stored (see Options.fused)")
    ap.add_argument("--activations", action="store_true",
                    help="also measure activation memory (rank (0, 0)'s graph on fake tensors; slower)")
    ap.add_argument("--dispatch", choices=("auto", "all_to_all", "gather"), default="auto",
                    help="how routed tokens reach their experts (see Options.moe_dispatch)")
    args = ap.parse_args(argv)
    for name in [args.only] if args.only else sorted(MODELS):
        for experts in args.experts or [None]:
            print(json.dumps(plan_one(name, args.layers, experts, args.fused, activations=args.activations,
                                      dispatch=args.dispatch)), flush=True)


if __name__ == "__main__":
    main()
