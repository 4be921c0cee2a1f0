"""Planning generation without the hardware: the prefill and decode programs of `autopar.generate`
compiled on a planning grid (no process group; a model built on the meta device), priced forward
only (inference: nothing is saved, no gradient is reduced).

For each phase: the bytes each rank receives per call and per token (the collective layer's
conventions, as `explain` counts them), the estimated time per call from the alpha-beta cost model
(`passes.search.estimate.price` with no gradients), and the KV cache a rank holds.

>>> import torch, transformers
>>> cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
...                                num_attention_heads=4, num_key_value_heads=4)
>>> with torch.device("meta"):
...     model = transformers.LlamaForCausalLM(cfg)
>>> rows = project(model, (2, 2), batch=4, prompt=8, max_len=16)
>>> [(r["phase"], r["tokens"], r["kv_cache_bytes_per_rank"]) for r in rows]
[('prefill', 32, 4096), ('decode', 4, 4096)]
"""

from __future__ import annotations

import torch

from passes import propagate
from passes.search import strategy as strategies
from passes.search.estimate import price
from passes.meta import LAYOUT
from passes.mesh import Grid
from passes.options import Options
from autopar.generate.cache import capture_cached, kv_cache_bytes_per_rank
from autopar.program.build import resolve_cost_model
from autopar.errors import UsageError

__all__ = ["project"]


def _inputs(batch: int, length: int, max_len: int, device) -> tuple:
    ids = torch.zeros(batch, length, dtype=torch.long, device=device)
    mask = torch.ones(batch, max_len, dtype=torch.long, device=device)
    return ids, mask, ids.clone(), torch.tensor(0, device=device)


def project(model, grid: tuple, *, batch: int, prompt: int, max_len: int, strategy: str = "2d",
            cost_model=None) -> list:
    """One dict per phase (prefill of `prompt` tokens, decode of one token per sequence) for `model`
    on an R x C `grid` with `strategy` '2d' or '1d' (each matmul unit fixed so) or 'auto' (the search
    run on each phase's graph, priced as a forward alone, as `pmodel.generate` plans a phase): bytes
    received per rank per call and per token, estimated seconds per call, tokens per call, the bytes
    of parameter blocks the phase reads per rank (a unit replicated reads its whole weights), the KV
    cache bytes a rank holds and, for 'auto', the assignment. `model` may live on the meta device
    (nothing is allocated then)."""
    if strategy not in ("2d", "1d", "auto"):
        raise UsageError(f"strategy={strategy!r}: project prices '2d', '1d' (each unit fixed so) or 'auto' (the "
                         f"search per phase)")
    mesh = tuple(grid)
    cm = resolve_cost_model(cost_model)
    meta = any(p.is_meta for p in model.parameters())
    device = torch.device("meta") if meta else torch.device("cpu")
    dtype = next(model.parameters()).dtype
    rows = []
    for phase, length in (("prefill", prompt), ("decode", 1)):
        inputs = _inputs(batch, length, max_len, device)
        cap = capture_cached(model, batch, max_len, device, mesh, inputs)
        assignment = None
        if mesh[0] * mesh[1] > 1 and strategy == "auto":
            searched = Options(strategy="auto", forward_only=True, search_budget=None)
            assignment = strategies.choose(cap.gm, mesh, cm, searched).assignment
        elif mesh[0] * mesh[1] > 1:
            strategies.fixed(cap.gm, strategy)
        propagate(cap.gm, Grid.for_planning(*mesh).shape, Options(strategy=strategy))
        layouts = {n: n.meta[LAYOUT] for n in cap.gm.graph.nodes}
        est = price(list(cap.gm.graph.nodes), layouts, mesh, set(), cm)
        received = int(sum(est.bytes_per_axis))
        tokens = batch * length
        rows.append({"phase": phase, "grid": mesh, "strategy": strategy, "tokens": tokens,
                     "bytes_per_rank": received, "bytes_per_rank_per_token": received / tokens,
                     "estimated_s": est.time_s, "param_bytes_per_rank": est.param_bytes, "kv_cache_bytes_per_rank":
                         kv_cache_bytes_per_rank(model.config, batch, max_len, mesh, dtype), "assignment": assignment})
    return rows
