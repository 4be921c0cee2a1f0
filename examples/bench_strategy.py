"""Planner comparison of strategy='auto' against fixed 2D and fixed 1D at 4, 16 and 64 ranks.

For each model (built on the meta device from its config class) and each p: fixed 2D is SUMMA on the
square grid, fixed 1D is Megatron-style splits on (1, p), and auto picks the grid shape among every
R x C = p and a strategy per unit (`autopar.choose_grid`). Figures are estimated step times from the
alpha-beta model (default: published GPU-cluster figures, or --cost-model FILE from `autopar
calibrate`), with the search's solve time. One process; nothing of full size is allocated.

    python examples/bench_strategy.py [--cost-model FILE] [--models bench gpt2-xl llama-7b]
"""

from __future__ import annotations

import argparse
import time

import torch
import transformers

import autopar
from autopar.program.build import capture, resolve_cost_model
from autopar.bench.common import BATCH, CONFIG, SEQ
from passes.search import strategy as S


def build(name: str):
    if name == "bench":
        cfg, batch, seq = transformers.LlamaConfig(**CONFIG), BATCH, SEQ
        cls = transformers.LlamaForCausalLM
    elif name == "gpt2-xl":
        cfg = transformers.GPT2Config(n_layer=48, n_embd=1600, n_head=25, vocab_size=50257, n_positions=1024)
        batch, seq, cls = 8, 1024, transformers.GPT2LMHeadModel
    elif name == "llama-7b":
        cfg = transformers.LlamaConfig(num_hidden_layers=32, hidden_size=4096, intermediate_size=11008,
                                       num_attention_heads=32, num_key_value_heads=32, vocab_size=32000)
        batch, seq, cls = 8, 1024, transformers.LlamaForCausalLM
    else:
        raise SystemExit(f"unknown model {name!r}: bench, gpt2-xl or llama-7b")
    cfg.use_cache = False
    with autopar.meta_init():
        model = cls(cfg)
    ids = torch.zeros(batch, seq, dtype=torch.long)
    return model, dict(input_ids=ids, labels=ids)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cost-model", metavar="FILE")
    ap.add_argument("--models", nargs="+", default=["bench", "gpt2-xl", "llama-7b"])
    ns = ap.parse_args()
    cm = resolve_cost_model(ns.cost_model)
    print(f"cost model: {cm.source}; alpha {cm.alpha} s, beta {cm.beta} B/s, {cm.flops:.3g} FLOP/s\n")
    print("| model | p | fixed 2D (square) | fixed 1D (1 x p) | auto | grid | auto / best fixed | solve (all shapes) |")
    print("|---|---|---|---|---|---|---|---|")
    for name in ns.models:
        model, kw = build(name)
        t0 = time.perf_counter()
        gm = capture(model, (), kw).gm
        capture_s = time.perf_counter() - t0
        for p, q in ((4, 2), (16, 4), (64, 8)):
            t2d = S.estimate_fixed(gm, (q, q), cm, "2d").time_s
            t1d = S.estimate_fixed(gm, (1, p), cm, "1d").time_s
            t0 = time.perf_counter()
            best = None
            for shape in [(r, p // r) for r in range(1, p + 1) if p % r == 0]:
                c = S.choose(gm, shape, cm)
                if best is None or c.estimate.time_s < best[1].estimate.time_s:
                    best = (shape, c)
            solve = time.perf_counter() - t0
            shape, c = best
            print(f"| {name} | {p} | {t2d * 1e3:.1f} ms | {t1d * 1e3:.1f} ms | {c.estimate.time_s * 1e3:.1f} ms | "
                  f"{shape[0]}x{shape[1]} | {c.estimate.time_s / min(t2d, t1d):.2f} | {solve:.1f} s |", flush=True)
        print(f"| {name} | capture | {capture_s:.1f} s | | | | | |", flush=True)


if __name__ == "__main__":
    main()
