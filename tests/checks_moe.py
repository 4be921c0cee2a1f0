"""Rank-side checks of mixture-of-experts models with their experts split over the grid (run on every
rank of a gloo pool by tests/test_moe.py)."""

from __future__ import annotations

import copy

import torch

import autopar
import hf_families
import sweep_hf
from passes.layout import chunk_range
from tests.compare import ATOL_FRAC, RTOL, group_excess


def _same_token(kw: dict) -> dict:
    """Every position the same token: every token routes to the same top-k experts, so the others (and
    a grid row whose experts are all among them) get no tokens at all."""
    ids = torch.full_like(kw["input_ids"], 5)
    return dict(kw, input_ids=ids, labels=ids.masked_fill(kw["attention_mask"] == 0, -100))


def routed_experts(out) -> list:
    """Per MoE layer, the experts that received at least one token (from the router logits)."""
    k = 2
    return [sorted(set(logits.topk(k, dim=-1).indices.flatten().tolist())) for logits in out.router_logits]


def moe_parity(rank, name: str, grid: tuple, same_token: bool = False, other_shape: bool = False,
               dispatch: str = "auto", **config) -> dict:
    """The family whole on one process against parallelize on `grid`: every output (router logits
    included), the loss (with the router's load-balancing loss) and every gradient; the parameter
    bytes this rank holds; the ops gathered whole; which experts got tokens. `other_shape`: also the
    outputs of a call with another batch and sequence length."""
    torch.manual_seed(0)
    model, make = hf_families.build(name, **config)
    model.eval()
    ref = copy.deepcopy(model)
    kw = make(sweep_hf.BATCH, sweep_hf.SEQ, 1)
    if same_token:
        kw = _same_token(kw)
    want = ref(**kw)
    want.loss.backward()
    pm = autopar.parallelize(model, grid=grid, example_kwargs=kw, moe_dispatch=dispatch)
    got = pm(**kw)
    got.loss.backward()
    errs = sweep_hf.compare(ref, want, pm, got)
    if other_shape:  # a second signature: compiled again with the parameters' layouts pinned
        kw2 = make(2, 6, 2)
        errs.update({f"{k} (batch 2, seq 6)": v for k, v in
                     sweep_hf.compare(ref, ref(**kw2), pm, pm(**kw2)).items() if not k.startswith("grad ")})
    return {"errs": errs,
            "held": sum(p.to_local().numel() for p in pm.parameters()),
            "total": sum(p.numel() for p in pm.parameters()),
            "gathered": sorted({str(f.node.target) for f in pm.program.fallbacks if f.costly}),
            "routed": routed_experts(want) if getattr(want, "router_logits", None) else None,
            "kernels": sorted({type(m).__name__ for m in pm.program.gm.modules()})}


def _rel(got, want) -> float:
    got, want = got.detach().float(), want.detach().float()
    return float((got - want).norm() / want.norm().clamp_min(1e-12))


def moe_bf16(rank, grid: tuple) -> dict:
    """Mixtral in bf16, where transformers calls torch's `_grouped_mm`: the loss, the logits and every
    gradient as relative norm errors against one process in bf16, and the parameters this rank holds."""
    torch.manual_seed(0)
    model, make = hf_families.build("mixtral")
    model = model.to(torch.bfloat16).eval()
    ref = copy.deepcopy(model)
    kw = make(sweep_hf.BATCH, sweep_hf.SEQ, 1)
    want = ref(**kw)
    want.loss.backward()
    pm = autopar.parallelize(model, grid=grid, example_kwargs=kw)
    got = pm(**kw)
    got.loss.backward()
    full = sweep_hf._full
    errs = {"loss": _rel(full(got.loss), want.loss), "logits": _rel(full(got.logits), want.logits)}
    mine = dict(pm.named_parameters())
    errs.update({f"grad {n}": _rel(full(mine[n].grad), p.grad) for n, p in ref.named_parameters()})
    return {"errs": errs, "held": sum(p.to_local().numel() for p in pm.parameters()),
            "total": sum(p.numel() for p in pm.parameters()),
            "ops": sorted({str(n.target) for n in pm.program.captured.gm.graph.nodes if "grouped" in str(n.target)}),
            "gathered": sorted({str(f.node.target) for f in pm.program.fallbacks if f.costly})}


def moe_from_pretrained(rank, path: str, grid: tuple, dispatch: str = "auto") -> dict:
    """Mixtral saved in `path`, read back by `autopar.from_pretrained` (built on the meta device, so
    transformers' experts take their non-CPU branch: an integer histc) against the same model whole
    on one process: every output and every gradient."""
    torch.manual_seed(0)
    ref, make = hf_families.build("mixtral")
    ref.eval()
    kw = make(sweep_hf.BATCH, sweep_hf.SEQ, 1)
    want = ref(**kw)
    want.loss.backward()
    pm = autopar.from_pretrained(path, grid=grid, example_kwargs=kw, progress=False, moe_dispatch=dispatch)
    pm.eval()
    got = pm(**kw)
    got.loss.backward()
    histc = [n for n in pm.program.captured.gm.graph.nodes if "histc" in str(n.target)]
    return {"errs": sweep_hf.compare(ref, want, pm, got),
            "int_histc": sum(not n.args[0].meta["val"].is_floating_point() for n in histc)}


def torch_tp_parity(rank) -> dict:
    """`autopar bench --moe`'s PyTorch baseline (1D TP, each expert's intermediate dim split by
    `ExpertIntermediateParallel`) on a tiny Mixtral against one process: the loss and every gradient
    (gate|up gradients compared in the style's row order: gate block r next to up block r)."""
    from autopar.bench import moe as bench_moe

    torch.manual_seed(0)
    model, make = hf_families.build("mixtral", num_key_value_heads=4)  # PyTorch's 1D TP splits whole KV heads
    ref = copy.deepcopy(model)
    kw = make(sweep_hf.BATCH, sweep_hf.SEQ, 1)
    want = ref(**kw)
    want.loss.backward()
    tp = bench_moe.tp_1d(model)
    got = tp(**kw)
    got.loss.backward()
    mine, world = dict(tp.named_parameters()), torch.distributed.get_world_size()
    grads = {}
    for n, p in ref.named_parameters():
        g = p.grad
        if n.endswith("experts.gate_up_proj"):  # [E, 2I, H] -> the style's [E, (rank, gate|up, I/p), H]
            e, two_i, h = g.shape
            g = g.view(e, 2, world, two_i // 2 // world, h).transpose(1, 2).reshape(e, two_i, h)
        grads[n] = (sweep_hf._full(mine[n].grad), g)
    errs = group_excess({"loss": (got.loss, want.loss)}, RTOL, ATOL_FRAC, "output ")
    errs.update(group_excess(grads, RTOL, ATOL_FRAC, "grad "))
    return {"errs": errs}


def moe_routed_bytes(rank, grid: tuple) -> dict:
    """Mixtral with the all-to-all dispatch: the bytes its routing ops counted in one training step, per
    phase, next to the exact figure for the routing the router chose (read back from one process's
    router logits): per layer, the pairs each row sends to each row's experts."""
    torch.manual_seed(0)
    model, make = hf_families.build("mixtral")
    ref = copy.deepcopy(model)
    kw = make(sweep_hf.BATCH, sweep_hf.SEQ, 1)
    want = ref(**kw)
    pm = autopar.parallelize(model, grid=grid, example_kwargs=kw, moe_dispatch="all_to_all")
    log = pm.grid.log
    before = dict(log.bytes)
    pm(**kw).loss.backward()
    counted = {ph: sum(v - before.get((t, p), 0) for (t, p), v in log.bytes.items() if t.startswith("moe:") and p == ph)
               for ph in ("fwd", "bwd")}
    R, C = grid
    r, c = pm.grid.r, pm.grid.c
    k, E, H = model.config.num_experts_per_tok, model.config.num_local_experts, model.config.hidden_size
    block = H // C * 4  # one pair's [H/C] fp32 block
    exact = {"fwd": 0, "bwd": 0}
    for logits in want.router_logits:  # [T, E] per layer, tokens in row order
        ids = logits.topk(k, dim=-1).indices  # [T, k]
        rows = ids.chunk(R, 0)
        owner = [chunk_range(E, R, d) for d in range(R)]
        mine = [int(((x >= owner[r][0]) & (x < owner[r][1])).sum()) for x in rows]  # pairs from row s to row r
        away = sum(int(((rows[r] >= lo) & (rows[r] < hi)).sum()) for d, (lo, hi) in enumerate(owner) if d != r)
        n = sum(mine)
        a2a_in, a2a_back = (n - mine[r]) * block, away * block
        cols = (C - 1) * n * block  # the all-gather of the run, and its reduce-scatter of [n, H]
        counts = 2 * (R - 1) * E * 8  # the counts' all-gather, in dispatch and in combine
        offsets = 2 * (R - 1) * E * 8 // R  # the all-reduce of the counts
        exact["fwd"] += a2a_in + a2a_back + 2 * cols + counts + offsets
        exact["bwd"] += a2a_in + a2a_back + 2 * cols
    return {"counted": counted, "exact": exact, "at": (r, c)}


def moe_syncs(rank, grid: tuple) -> dict:
    """Host syncs of one training step (forward and backward, after a first one) of a Mixtral of 8 experts
    with checks='late' (the input checks' verdicts read by the next call, without a wait): by site, and
    the expert kernels the program calls."""
    torch.manual_seed(0)
    model, make = hf_families.build("mixtral", num_local_experts=8)
    kw = make(sweep_hf.BATCH, sweep_hf.SEQ, 1)
    pm = autopar.parallelize(model, grid=grid, example_kwargs=kw, checks="late")
    pm(**kw).loss.backward()  # the first step: programs compiled, the checks' host buffers made
    with autopar.count_host_syncs() as syncs:
        pm(**kw).loss.backward()
    kernels: dict = {}
    for m in pm.program.gm.modules():
        if getattr(m, "split", True):  # ExpertBlockMM with its experts whole runs transformers' op as captured
            kernels[type(m).__name__] = kernels.get(type(m).__name__, 0) + 1
    autopar.flush_checks()
    return {"sites": dict(syncs.sites), "total": syncs.total,
            "ours": syncs.own, "kernels": kernels}
