"""`python -m autopar bench --generate`: generation throughput, measured in one run for the same
transformers Llama-style model (`autopar.bench`'s) as:

- one process, transformers' `generate` (its dynamic KV cache);
- autopar `pmodel.generate` on a 2x2 grid (eager, and with `compile=True`: its prefill and decode
  programs under torch.compile, compiled in the warm-up round), a 1x4 grid, and strategy='auto' on 2x2 (published cost
  figures unless --cost-model names a file; its phases each searched, the default, and both running
  the forward's plan, 'forward'); the 2x2 model also with its decode planned 1D
  (`decode_strategy='1d'`) and with both phases planned by the search (`'auto'`);
- PyTorch's 1D tensor parallel (`parallelize_module` on the HF model, as `autopar.bench` builds it)
  with transformers' `generate`, on 4 ranks;

for batch 1 and batch 8. Prefill time is a generate of one new token; decode time per step is the
difference to a generate of 1 + N new tokens, divided by N (min_new_tokens keeps every row going).
Bytes received per rank per decoded token come from the same difference: autopar's collective layer
plus the functional collectives DTensor issues (the logits autopar gathers, all of PyTorch 1D's).
Configurations alternate round by round; medians are reported. Then the planner's projection for a
Llama-7B shape, 2D and a search per phase on 8x8 against 1D on 64 ranks (`autopar.generate.plan.project`).
"""

from __future__ import annotations

import copy
import json
import os
import statistics
import time
import warnings

import torch
import torch.distributed as dist

import autopar
from autopar.bench import common
from autopar.bench.common import CONFIG, FunctionalCommBytes
from autopar.launch import close, init_local
from passes.cost.cube import megatron_bytes
from autopar.parallel.module import ParallelModule
from passes.search.strategy import SearchWarning

PROMPT, NEW, BATCHES = 32, 8, (1, 8)


def _generate(m, ids, new):
    model, extra = m
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new, do_sample=False,
              pad_token_id=0, **extra)
    return model.generate(ids, **kw)


def _configs(rank, cost_model) -> dict:
    base = common.model().eval()
    ids = torch.randint(1, CONFIG["vocab_size"], (8, PROMPT))
    kw = {"attention_mask": torch.ones_like(ids)}
    out = {"one process": (base, {})} if rank == 0 else {}
    for name, grid, strategy in (("autopar 2x2", (2, 2), "2d"), ("autopar 1x4", (1, 4), "2d"),
                                 ("autopar auto 2x2", (2, 2), "auto")):
        pm = autopar.parallelize(copy.deepcopy(base), grid, (ids,), kw, strategy=strategy, cost_model=cost_model)
        out[name] = (pm.eval(), {})
    compiled = autopar.parallelize(copy.deepcopy(base), (2, 2), (ids,), kw, compile=True)
    out["autopar 2x2 compiled"] = (compiled.eval(), {})
    out["autopar 2x2, decode 1d"] = (out["autopar 2x2"][0], {"decode_strategy": "1d"})
    out["autopar 2x2, phases auto"] = (out["autopar 2x2"][0], {"prefill_strategy": "auto", "decode_strategy": "auto"})
    out["autopar auto 2x2, forward's plan"] = (out["autopar auto 2x2"][0],
                                               {"prefill_strategy": "forward", "decode_strategy": "forward"})
    out["PyTorch 1D TP (4 ranks)"] = (common.tp_1d(copy.deepcopy(base)).eval(), {})
    return out


def _measure(m, ids, world) -> tuple:
    """(seconds for a 1-token generate, for a 1+NEW one, bytes received per rank by each)."""
    res = []
    for new in (1, 1 + NEW):
        counter = FunctionalCommBytes(world)
        grid = getattr(m[0], "grid", None)
        if grid is not None:
            grid.log.reset()
        t0 = time.perf_counter()
        with counter:
            _generate(m, ids, new)
        res.append((time.perf_counter() - t0, counter.bytes + (grid.log.total() if grid is not None else 0)))
    return res[0][0], res[1][0], res[0][1], res[1][1]


def worker(rank, world, port, rounds, out, cost_model):
    init_local(rank, world, port)
    torch.manual_seed(0)
    configs = _configs(rank, cost_model)
    names = ["one process", "autopar 2x2", "autopar 2x2 compiled", "autopar 1x4", "autopar auto 2x2",
             "autopar auto 2x2, forward's plan",
             "autopar 2x2, decode 1d", "autopar 2x2, phases auto", "PyTorch 1D TP (4 ranks)"]
    results = {}
    for batch in BATCHES:
        ids = torch.randint(1, CONFIG["vocab_size"], (batch, PROMPT), generator=torch.Generator().manual_seed(batch))
        samples = {k: [] for k in names}
        for _ in range(rounds + 1):  # round 0 compiles and warms up
            for k in names:
                dist.barrier()
                if k not in configs:
                    continue
                samples[k].append(_measure(configs[k], ids, world))
        for k in configs:
            runs = samples[k][1:]
            prefill = statistics.median(s[0] for s in runs)
            decode = statistics.median((s[1] - s[0]) / NEW for s in runs)
            moved = (runs[-1][3] - runs[-1][2]) / (NEW * batch)
            model = configs[k][0]
            cache = model.generator.kv_cache_bytes() if isinstance(model, ParallelModule) else None
            results[f"{k}|{batch}"] = {"prefill_tok_s": batch * PROMPT / prefill, "decode_tok_s": batch / decode,
                                       "bytes_per_decoded_token": moved, "kv_cache_bytes_per_rank": cache}
    everyone = [None] * world
    dist.all_gather_object(everyone, results)
    if rank == 0:
        merged = {k: {m: min(r[k][m] for r in everyone if k in r) if m.endswith("tok_s") else
                      max((r[k][m] for r in everyone if k in r and r[k][m] is not None), default=None)
                      for m in results[k]} for k in results}
        with open(out, "w") as f:
            json.dump(merged, f)
    close()


def projection(cost_model=None) -> list:
    """The planner's prefill and decode for a Llama-7B shape (fp16, batch 8, prompt 512, cache 1024):
    2D on 8x8 and 1D on 1x64, built on the meta device."""
    import transformers

    from autopar.generate.plan import project

    cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                                   num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg).to(torch.float16)
    rows = []
    with warnings.catch_warnings():  # the searches of the 8x8 phases run ~30 s each without a budget: expected
        warnings.simplefilter("ignore", SearchWarning)
        for grid, strategy in (((8, 8), "2d"), ((8, 8), "auto"), ((1, 64), "1d")):
            rows += project(model, grid, batch=8, prompt=512, max_len=1024, strategy=strategy, cost_model=cost_model)
    return rows + megatron_1d(cfg, 64, batch=8, prompt=512)


def megatron_1d(cfg, p: int, *, batch: int, prompt: int, elem: int = 2) -> list:
    """Megatron 1D at `p` ranks, analytically (heads assumed divisible by p): the forward of
    `passes.cost.cube.megatron_bytes`, per layer two ring all-reduces of the [tokens, hidden]
    activations, plus one for the vocab-parallel embedding."""
    rows = []
    for phase, tokens in (("prefill", batch * prompt), ("decode", batch)):
        fwd, _ = megatron_bytes(tokens, cfg.hidden_size, cfg.num_hidden_layers, p, elem)
        rows.append({"phase": phase, "grid": (1, p), "strategy": "Megatron 1D (analytic)", "tokens": tokens,
                     "bytes_per_rank": fwd, "bytes_per_rank_per_token": fwd / tokens, "estimated_s": None,
                     "kv_cache_bytes_per_rank": None})
    return rows


def markdown(res: dict, proj: list) -> str:
    lines = ["| configuration | batch | prefill tokens/s | decode tokens/s | received/rank/decoded token | "
             "KV cache/rank |", "|---|---|---|---|---|---|"]
    for key, r in res.items():
        name, batch = key.rsplit("|", 1)
        cache = f"{r['kv_cache_bytes_per_rank'] / 2**10:.0f} KiB" if r["kv_cache_bytes_per_rank"] else "(HF cache)"
        lines.append(f"| {name} | {batch} | {r['prefill_tok_s']:.0f} | {r['decode_tok_s']:.1f} | "
                     f"{r['bytes_per_decoded_token'] / 2**10:.1f} KiB | {cache} |")
    if proj:
        lines += ["", "Planner projection, Llama-7B shape (fp16, batch 8, prompt 512, KV cache 1024 slots; published "
                  "GPU-cluster cost figures):", "",
                  "| grid | phase | received/rank/call | received/rank/token | estimated time/call | KV cache/rank | "
                  "parameters/rank |", "|---|---|---|---|---|---|---|"]
        for r in proj:
            est = f"{r['estimated_s'] * 1e3:.2f} ms" if r["estimated_s"] is not None else "-"
            cache = f"{r['kv_cache_bytes_per_rank'] / 2**20:.1f} MiB" if r["kv_cache_bytes_per_rank"] else "-"
            params = f"{r['param_bytes_per_rank'] / 2**30:.2f} GiB" if r.get("param_bytes_per_rank") else "-"
            lines.append(f"| {r['grid'][0]}x{r['grid'][1]} {r['strategy']} | {r['phase']} | "
                         f"{r['bytes_per_rank'] / 2**20:.1f} MiB | {r['bytes_per_rank_per_token'] / 2**10:.1f} KiB | "
                         f"{est} | {cache} | {params} |")
        one = {r["phase"]: r for r in proj if r["strategy"] == "1d"}
        for name, strategy in (("2D 8x8", "2d"), ("auto per phase 8x8", "auto")):
            mine = {r["phase"]: r for r in proj if r["strategy"] == strategy}
            lines.append(f"\nestimated forward throughput {name} / 1D 64: " + ", ".join(
                f"{p} {one[p]['estimated_s'] / mine[p]['estimated_s']:.2f}x" for p in ("prefill", "decode")))
        for r in proj:
            if r.get("assignment"):
                lines.append(f"\n{r['grid'][0]}x{r['grid'][1]} auto {r['phase']}: " + "; ".join(
                    f"{k.split(':', 1)[1]} {v}" for k, v in r["assignment"].items()))
    return "\n".join(lines)


def run(ns) -> int:
    """`autopar bench --generate` for parsed flags (--rounds, --json, --cost-model)."""
    import tempfile

    out = os.path.join(tempfile.mkdtemp(), "generate.json")
    common.spawn(worker, 4, ns.rounds, out, ns.cost_model)
    res = json.load(open(out))
    proj = projection(ns.cost_model)
    if ns.json:
        print(json.dumps({"model": CONFIG, "prompt": PROMPT, "new_tokens": NEW, "results": res, "projection": proj},
                         indent=2))
    else:
        print(f"Llama-style model {CONFIG}, prompt {PROMPT} tokens, {NEW} decoded, gloo on CPU\n")
        print(markdown(res, proj))
    return 0
