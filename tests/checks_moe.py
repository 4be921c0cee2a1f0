"""Rank-side checks of mixture-of-experts models with their experts split over the grid (run on every
rank of a gloo pool by tests/test_moe.py)."""

from __future__ import annotations

import copy

import torch

import autopar
import hf_families
import sweep_hf
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
               **config) -> dict:
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
    pm = autopar.parallelize(model, grid=grid, example_kwargs=kw)
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
            "routed": routed_experts(want) if getattr(want, "router_logits", None) else None}


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


def moe_from_pretrained(rank, path: str, grid: tuple) -> dict:
    """Mixtral saved in `path`, read back by `autopar.from_pretrained` (built on the meta device, so
    transformers' experts take their non-CPU branch: an integer histc) against the same model whole
    on one process: every output and every gradient."""
    torch.manual_seed(0)
    ref, make = hf_families.build("mixtral")
    ref.eval()
    kw = make(sweep_hf.BATCH, sweep_hf.SEQ, 1)
    want = ref(**kw)
    want.loss.backward()
    pm = autopar.from_pretrained(path, grid=grid, example_kwargs=kw, progress=False)
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
    from autopar import bench_moe

    torch.manual_seed(0)
    model, make = hf_families.build("mixtral", num_key_value_heads=4)  # PyTorch's 1D TP splits whole KV heads
    ref = copy.deepcopy(model)
    kw = make(sweep_hf.BATCH, sweep_hf.SEQ, 1)
    want = ref(**kw)
    want.loss.backward()
    tp = bench_moe._tp_1d(model)
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
