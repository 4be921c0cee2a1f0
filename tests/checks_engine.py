"""Checks that run on every rank of a test pool (see dist_pool.py). Each returns plain data; the
test in the parent process asserts on it, so a failure names the parameter and the error."""

from __future__ import annotations

import copy
import warnings

import torch
from torch.distributed.tensor import Replicate

import autopar
from autopar.planning.explain import rows
from models import GPTConfig, TinyGPT
from tests.compare import excess, group_excess


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _data(cfg: GPTConfig, batch: int, seq: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)
    tgt = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)
    return ids, tgt


def gpt_parity(rank, q, cfg_kw, lowering="broadcast", batch=4, seq=8, steps=3, **options):
    """Outputs, loss, every gradient and the parameters after `steps` AdamW steps, against the
    unmodified model on one process. `q`: a q x q grid, or an (R, C) tuple; `options` go to parallelize."""
    torch.manual_seed(0)
    cfg = GPTConfig(**cfg_kw)
    model = TinyGPT(cfg)
    before = {n: p.detach().clone() for n, p in model.state_dict().items()}
    ref = copy.deepcopy(model)
    ids, tgt = _data(cfg, batch, seq)
    grid = tuple(q) if isinstance(q, (tuple, list)) else (q, q)
    pm = autopar.parallelize(model, grid=grid, example_inputs=(ids, tgt), lowering=lowering, **options)
    # parallelize must not touch the user's model: bit equality
    errs = {"model unchanged": max(excess(p, before[n], 0.0, 0.0) for n, p in model.state_dict().items())}
    names_match = sorted(n for n, _ in pm.named_parameters()) == sorted(n for n, _ in ref.named_parameters())
    # Adam divides by |grad| + eps: for an element whose gradient is ~1e-8 (fp32 noise level next to
    # a max of 1e-2) the default eps=1e-8 turns a 1e-9 rounding difference into a 1e-5 step
    # difference (measured: 7e-5 relative after 3 steps, lr 1e-3). eps=1e-6 keeps the comparison
    # about the engine, not about Adam's conditioning near zero.
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3, eps=1e-6)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=1e-6)
    ref_params = dict(ref.named_parameters())
    for step in range(steps):
        ids, tgt = _data(cfg, batch, seq, seed=step + 1)
        logits, loss = pm(ids, tgt)
        ref_logits, ref_loss = ref(ids, tgt)
        loss.backward()
        ref_loss.backward()
        if step == 0:
            errs.update(group_excess({"logits": (logits.full_tensor(), ref_logits)}))
            errs.update(group_excess({"loss": (_full(loss), ref_loss)}))
            errs.update(group_excess({n: (p.grad.full_tensor(), ref_params[n].grad)
                                      for n, p in pm.named_parameters()}, prefix="grad "))
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    errs.update(group_excess({n: (p.full_tensor(), ref_params[n]) for n, p in pm.named_parameters()},
                             prefix=f"param after {steps} steps "))
    return {"excess": errs, "names match": names_match}


def _saved_bytes(fn):
    """Bytes of the distinct storages autograd saves for backward while running fn()."""
    storages = {}

    def pack(t):
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(storages.values()), out


def gpt_memory(rank, q, cfg_kw, batch=8, seq=16):
    """Parameter bytes per rank (each 2D weight and in total) and bytes saved for backward."""
    torch.manual_seed(0)
    cfg = GPTConfig(**cfg_kw)
    model = TinyGPT(cfg)
    ids, tgt = _data(cfg, batch, seq)
    pm = autopar.parallelize(model, grid=(q, q), example_inputs=(ids, tgt))
    weights = {}
    for n, p in pm.named_parameters():
        if p.dim() == 2:
            weights[n] = (p.to_local().numel(), p.numel(), [str(pl) for pl in p.placements])
    held = sum(p.to_local().numel() for p in pm.parameters())
    full = sum(p.numel() for p in pm.parameters())
    saved, _ = _saved_bytes(lambda: pm(ids, tgt))
    ref_saved, _ = _saved_bytes(lambda: model(ids, tgt))
    return {"weights": weights, "held": held, "full": full, "saved": saved, "ref_saved": ref_saved}


def gpt_bytes(rank, q, cfg_kw, lowering, batch=4, seq=8):
    """Bytes the collective layer counted in one training step, per SUMMA module path, and the
    explain plan's total for the same step."""
    torch.manual_seed(0)
    cfg = GPTConfig(**cfg_kw)
    model = TinyGPT(cfg)
    ids, tgt = _data(cfg, batch, seq)
    pm = autopar.parallelize(model, grid=(q, q), example_inputs=(ids, tgt), lowering=lowering)
    pm.grid.log.reset()
    _, loss = pm(ids, tgt)
    loss.backward()
    measured = {}
    for r in rows(pm):
        if r.op.startswith(("SummaLinear", "SummaMember")):  # a grouped sibling: SummaMember
            measured[r.module] = sum(v for (tag, _), v in pm.grid.log.bytes.items() if tag == r.node)
    planned = sum(r.fwd_bytes + r.bwd_bytes for r in rows(pm))
    why = [line for line in autopar.explain(pm, formulas=True).splitlines() if line.startswith("    why:")]
    return {"summa": measured, "planned": planned, "total": pm.grid.log.total(), "why": why}


def expect_error(rank, kind):
    """Run a misuse and return (exception type name, message) or the warnings raised."""
    torch.manual_seed(0)
    cfg = GPTConfig(layers=1)
    ids, tgt = _data(cfg, 4, 8)
    try:
        if kind == "world":
            autopar.parallelize(TinyGPT(cfg), grid=(3, 3), example_inputs=(ids,))
        elif kind == "rect_wrong_size":
            autopar.parallelize(TinyGPT(cfg), grid=(1, 2), example_inputs=(ids,))
        elif kind == "indivisible":
            autopar.parallelize(torch.nn.Sequential(torch.nn.Linear(16, 7)), grid=(2, 2),
                                example_inputs=(torch.randn(4, 16),), indivisible="error")
        elif kind == "capture":
            autopar.parallelize(DataDependent(), grid=(2, 2), example_inputs=(torch.randn(4, 8),))
        elif kind == "lowering":
            autopar.parallelize(TinyGPT(cfg), grid=(2, 2), example_inputs=(ids,), lowering="cannon")
    except Exception as e:
        return type(e).__name__, str(e)
    return None, ""


class DataDependent(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        if x.sum() > 0:  # data-dependent control flow: torch.export cannot trace this
            return self.lin(x)
        return x


def indivisible_replicate(rank, indivisible="replicate"):
    """A weight that q does not divide runs unsplit with a warning (indivisible='replicate'; with
    'uneven' only the one whose in-features q does not divide), and stays correct; with the warning made
    an error, parallelize raises it."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 7), torch.nn.GELU(), torch.nn.Linear(7, 4))
    x = torch.randn(4, 16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pm = autopar.parallelize(model, grid=(2, 2), example_inputs=(x,), indivisible=indivisible)
    out = _full(pm(x))
    out.sum().backward()
    ref = model(x)
    ref.sum().backward()
    ref_params = dict(model.named_parameters())
    errs = group_excess({"out": (out, ref)})
    errs.update(group_excess({n: (p.grad.full_tensor(), ref_params[n].grad) for n, p in pm.named_parameters()},
                             prefix="grad "))
    msgs = [str(w.message) for w in caught if issubclass(w.category, autopar.FallbackWarning)]
    with warnings.catch_warnings():
        warnings.simplefilter("error", autopar.FallbackWarning)
        try:
            autopar.parallelize(copy.deepcopy(model), grid=(2, 2), example_inputs=(x,), indivisible=indivisible)
            raised = ""
        except autopar.FallbackWarning as e:
            raised = type(e).__name__
    return errs, msgs, raised


def everyday_use(rank):
    """Other shapes than the example, eval/train switching, clip_grad_norm_ over DTensor grads."""
    torch.manual_seed(0)
    cfg = GPTConfig(layers=1, dropout=0.1)
    model = TinyGPT(cfg)
    ids, tgt = _data(cfg, 4, 8)
    pm = autopar.parallelize(model, grid=(2, 2), example_inputs=(ids, tgt))
    model.eval()
    pm.eval()
    ids2, tgt2 = _data(cfg, 8, 16, seed=5)  # other batch and sequence length, eval mode: no dropout
    logits, loss = pm(ids2, tgt2)
    ref_logits, ref_loss = model(ids2, tgt2)
    errs = group_excess({"eval other shape logits": (logits.full_tensor(), ref_logits)})
    errs.update(group_excess({"eval loss": (_full(loss), ref_loss)}))
    loss.backward()
    ref_loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(pm.parameters(), max_norm=0.5)
    ref_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
    errs.update(group_excess({"clip norm": (_full(norm), ref_norm)}))
    ref_params = dict(model.named_parameters())
    errs.update(group_excess({n: (p.grad.full_tensor(), ref_params[n].grad) for n, p in pm.named_parameters()},
                             prefix="clipped grad "))
    pm.train()
    model.train()
    _, train_loss = pm(ids, tgt)  # dropout on: a different (random) loss, but finite and compiled anew
    return {"excess": errs, "graphs": len(pm.programs), "train loss finite": bool(torch.isfinite(train_loss).item())}


def replicated_drift(rank, drift_rank):
    """A copy of a replicated parameter nudged on `drift_rank` only: {parameter: excess} on this rank,
    and the name of the nudged parameter. The parity checks read each rank's own copy, so this must
    show on `drift_rank` and on no rank outside its groups."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.LayerNorm(16), torch.nn.Linear(16, 32), torch.nn.GELU(),
                                torch.nn.Linear(32, 16))
    x = torch.randn(4, 8, 16)
    pm = autopar.parallelize(model, grid=(2, 2), example_inputs=(x,))
    name, p = next((n, p) for n, p in pm.named_parameters() if any(isinstance(pl, Replicate) for pl in p.placements))
    if rank == drift_rank:
        with torch.no_grad():
            p.to_local()[0] += 1e-3  # one element of this rank's copy
    ref_params = dict(model.named_parameters())
    return group_excess({n: (q.full_tensor(), ref_params[n]) for n, q in pm.named_parameters()}), name


def gpt_calls(rank, grid, cfg_kw, lowering, batch=4, seq=8):
    """Collective calls one training step launched, in total per phase and per SUMMA node, and what
    explain's rows plan for the same step."""
    torch.manual_seed(0)
    cfg = GPTConfig(**cfg_kw)
    model = TinyGPT(cfg)
    ids, tgt = _data(cfg, batch, seq)
    pm = autopar.parallelize(model, grid=grid, example_inputs=(ids, tgt), lowering=lowering)
    pm.grid.log.reset()
    _, loss = pm(ids, tgt)
    loss.backward()
    log, table = pm.grid.log, rows(pm)
    summa = {r.node: ((r.calls_fwd, r.calls_bwd), (log.launches[(r.node, "fwd")], log.launches[(r.node, "bwd")]))
             for r in table if r.op.startswith(("SummaLinear", "SummaMember"))}
    text = autopar.explain(pm).splitlines()
    line = next(ln for ln in text if ln.startswith("collectives per rank per step"))
    return {"planned": (sum(r.calls_fwd for r in table), sum(r.calls_bwd for r in table)),
            "counted": (log.calls(phase="fwd"), log.calls(phase="bwd")), "summa": summa, "line": line,
            "overlap": [ln for ln in text if ln.startswith("overlap:")]}
