"""`python -m autopar bench --search`: the arrangement search (`autopar.choose_grid`) on a Llama-7B shape
at 64 and 512 ranks, on one process, nothing of full size allocated.

The model: Llama-7B's sizes (32 blocks, hidden 4096, intermediate 11008, 32 heads, vocabulary 32000) built
on the meta device in bf16, trained on 16 sequences of 4096 tokens per step (the `--dimensions` table's
step). Per device count, twice: with replica layouts (what `choose_grid` prices by default) and without
(what `parallelize(grid=p, strategy='auto')` runs), and at 512 once more under memory_limit=2GiB.
Printed: the candidates priced and searched, the
seconds the search took (captures included), the arrangement picked and its estimated step, and for
comparison the best fixed scheme over every arrangement, the best 2D grid's search and the cube's (fixed
3D and searched). Estimates use the cost model given (default: published GPU-cluster figures).
"""

from __future__ import annotations

import json
import time

import torch

__all__ = ["run", "measure"]

SIZES = dict(num_hidden_layers=32, hidden_size=4096, intermediate_size=11008, num_attention_heads=32,
             num_key_value_heads=32, vocab_size=32000)
BATCH, SEQ = 16, 4096
DEVICES = (64, 512)
LIMIT = "2GiB"  # a memory_limit below the unconstrained pick's at 512 ranks (5.3 GiB)


def _model():
    import transformers

    import autopar

    with autopar.meta_init():
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SIZES, use_cache=False))
    ids = torch.zeros(BATCH, SEQ, dtype=torch.long)
    return model.to(torch.bfloat16), dict(input_ids=ids, labels=ids)


def measure(devices: int, replica_layouts: bool, cost_model=None, memory_limit=None) -> dict:
    """One search's figures (see the module's text)."""
    import autopar
    from autopar.planning.grids import describe

    model, kw = _model()
    t0 = time.perf_counter()
    gc = autopar.choose_grid(model, devices, (), kw, cost_model=cost_model, replica_layouts=replica_layouts,
                             memory_limit=memory_limit)
    took = time.perf_counter() - t0
    fixed = min(((t, s, row) for row in gc.table for s, t in row["fixed_s"].items()), key=lambda x: x[0])
    two_d = [row for row in gc.table if row["layout"] == "2d" and row["searched"] and row["fits"]]
    best_2d = min(two_d, key=lambda row: row["auto_s"]) if two_d else None
    cube = next((row for row in gc.table if row["layout"] == "3d"), None)
    return {"devices": devices, "replica_layouts": replica_layouts, "memory_limit": memory_limit,
            "recomputed_blocks": len(gc.choice.recompute_blocks), "candidates": len(gc.table),
            "searched": sum(row["searched"] for row in gc.table), "seconds": took,
            "picked": describe(gc.layout, gc.grid), "picked_s": gc.best["auto_s"],
            "picked_memory_bytes": gc.best["memory_bytes"],
            "best_fixed": f"{fixed[1]} on {describe(fixed[2]['layout'], fixed[2]['grid'])}", "best_fixed_s": fixed[0],
            "best_2d": describe("2d", best_2d["grid"]) if best_2d else None,
            "best_2d_s": best_2d["auto_s"] if best_2d else None,
            "cube_fixed_3d_s": cube["fixed_s"]["3d"] if cube else None,
            "cube_s": cube["auto_s"] if cube else None,
            "assignment": gc.best["assignment"]}


def markdown(rows: list) -> str:
    lines = ["| ranks | replica layouts | memory_limit | candidates (searched) | search | picked | its step | "
             "its memory/rank | best fixed scheme | picked / best fixed | best 2D grid (searched) | "
             "cube: fixed 3D, searched |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cube = (f"{r['cube_fixed_3d_s'] * 1e3:.0f} ms, {r['cube_s'] * 1e3:.0f} ms" if r["cube_s"] is not None
                else (f"{r['cube_fixed_3d_s'] * 1e3:.0f} ms, not searched" if r["cube_fixed_3d_s"] else "-"))
        recomputed = f", {r['recomputed_blocks']} blocks recomputed" if r["recomputed_blocks"] else ""
        lines.append(f"| {r['devices']} | {'yes' if r['replica_layouts'] else 'no'} | {r['memory_limit'] or '-'} | "
                     f"{r['candidates']} ({r['searched']}) | {r['seconds']:.1f} s | {r['picked']}{recomputed} | "
                     f"{r['picked_s'] * 1e3:.0f} ms | {r['picked_memory_bytes'] / 2**30:.2f} GiB | "
                     f"{r['best_fixed']}, {r['best_fixed_s'] * 1e3:.0f} ms | {r['picked_s'] / r['best_fixed_s']:.2f} | "
                     + (f"{r['best_2d']}, {r['best_2d_s'] * 1e3:.0f} ms" if r["best_2d"] else "none searched")
                     + f" | {cube} |")
    return "\n".join(lines)


def run(ns) -> int:
    """The search benchmark for `autopar bench`'s parsed flags (--cost-model, --json)."""
    rows = [measure(p, rep, ns.cost_model) for p in DEVICES for rep in (True, False)]
    rows.append(measure(DEVICES[-1], True, ns.cost_model, LIMIT))
    print(json.dumps(rows, indent=2) if ns.json else markdown(rows))
    return 0
