"""Checks of activation recomputation (parallelize(..., recompute=...)) that run on every rank of a
test pool; the tests in test_recompute.py assert on what they return."""

from __future__ import annotations

import copy

import torch

import autopar
from autopar.planning.explain import rows
from models import GPTConfig, TinyGPT
from tests.checks_engine import _data
from tests.compare import group_excess

DROPOUT = dict(vocab_size=64, max_seq=16, hidden=32, heads=4, layers=1, dropout=0.2)
SWIGLU = dict(DROPOUT, norm="rmsnorm", mlp="swiglu")  # silu(gate) * up: a region 'selective' recomputes


def _saved(fn):
    """(bytes of the distinct tensors autograd saves for backward while running fn(), fn's result):
    the convention `autopar.plan` measures activation_bytes with."""
    saved = {}

    def pack(t):
        saved[id(t)] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(saved.values()), out


def dropout_same_masks(rank, grid, mode, steps=2):
    """TinyGPT with dropout 0.2 in train mode, parallelized twice from one model, with and without
    recomputation, each call after the same manual_seed: the recomputed forward must draw the masks
    its forward drew, so outputs, every gradient and the parameters after AdamW steps agree."""
    torch.manual_seed(0)
    cfg = GPTConfig(**DROPOUT)
    model = TinyGPT(cfg)
    ids, tgt = _data(cfg, 4, 8)
    plain = autopar.parallelize(copy.deepcopy(model), grid=grid, example_inputs=(ids, tgt))
    again = autopar.parallelize(model, grid=grid, example_inputs=(ids, tgt), recompute=mode)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3, eps=1e-6) for m in (plain, again)]
    errs = {}
    for step in range(steps):
        ids, tgt = _data(cfg, 4, 8, seed=step + 1)
        outs = []
        for m in (plain, again):
            torch.manual_seed(100 + step)
            logits, loss = m(ids, tgt)
            loss.backward()
            outs.append((logits.full_tensor(), loss.full_tensor() if hasattr(loss, "full_tensor") else loss))
        errs.update(group_excess({f"logits {step}": (outs[1][0], outs[0][0])}))
        errs.update(group_excess({f"loss {step}": (outs[1][1], outs[0][1])}))
        want = dict(plain.named_parameters())
        errs.update(group_excess({n: (p.grad.full_tensor(), want[n].grad.full_tensor())
                                  for n, p in again.named_parameters()}, prefix=f"grad {step} "))
        for o in opts:
            o.step()
            o.zero_grad()
    want = dict(plain.named_parameters())
    errs.update(group_excess({n: (p.full_tensor(), want[n].full_tensor()) for n, p in again.named_parameters()},
                             prefix=f"param after {steps} steps "))
    return errs


def counted(rank, grid, mode):
    """One training step of TinyGPT (SwiGLU, dropout 0.2) with recomputation: the bytes the collective layer counted per
    phase ("fwd", "bwd", "recompute") against explain's rows, and the bytes saved for backward on
    this rank (compared in the test with `autopar.plan`'s measurement on a fake process group)."""
    torch.manual_seed(0)
    cfg = GPTConfig(**SWIGLU)
    model = TinyGPT(cfg)
    ids, tgt = _data(cfg, 4, 8)
    pm = autopar.parallelize(model, grid=grid, example_inputs=(ids, tgt), recompute=mode)
    pm.grid.log.reset()
    saved, (_, loss) = _saved(lambda: pm(ids, tgt))
    loss.backward()
    phases: dict = {}
    for (_, phase), v in pm.grid.log.bytes.items():
        phases[phase] = phases.get(phase, 0) + v
    calls = {ph: pm.grid.log.calls(phase=ph) for ph in ("fwd", "bwd", "recompute")}
    table = rows(pm)
    planned = {"fwd": sum(r.fwd_bytes for r in table), "bwd": sum(r.bwd_bytes for r in table),
               "recompute": sum(r.recompute_bytes for r in table)}
    planned_calls = {"fwd": sum(r.calls_fwd for r in table), "bwd": sum(r.calls_bwd for r in table),
                     "recompute": sum(r.calls_fwd for r in table if r.recompute_bytes)}
    return {"counted": phases, "planned": planned, "saved": saved, "calls": calls, "planned_calls": planned_calls,
            "explain": autopar.explain(pm) if rank == 0 else ""}
