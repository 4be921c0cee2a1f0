"""Rank-side checks for ragged batches: a model parallelized for one input shape, then called with
batches and sequences the grid does not divide (a dataloader's last batch), in train and eval mode.
Each returns plain data for the test to assert on."""

from __future__ import annotations

import copy
import warnings

import torch

import autopar
from models import GPTConfig, TinyGPT
from tests.checks_hf import build
from tests.compare import group_excess

CAPTURE = (4, 8)  # (batch, sequence) of parallelize's example inputs
RAGGED = ((3, 7), (1, 5), (4, 8), (5, 9))  # the calls that follow, the captured shape among them


def _model(family: str):
    """(model, call-maker) with dropout off, so train mode computes the same function on both sides;
    call-maker(batch, seq, seed) gives (args, kwargs) of one call."""
    torch.manual_seed(0)
    if family == "tiny":
        model = TinyGPT(GPTConfig(layers=1))

        def tiny(b, s, seed):
            g = torch.Generator().manual_seed(seed)
            return (torch.randint(0, 64, (b, s), generator=g), torch.randint(0, 64, (b, s), generator=g)), {}

        return model, tiny
    over = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0) if family == "gpt2" else {}
    model, make = build(family, **over)
    return model, lambda b, s, seed: ((), make(b, s, seed))


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _loss_and_logits(out):
    """(loss, logits) as full tensors, from TinyGPT's (logits, loss) or a transformers output."""
    logits, loss = out if isinstance(out, tuple) else (out.logits, out.loss)
    return _full(loss), _full(logits)


def ragged_parity(rank, family: str, grid=(2, 2), **options):
    """Logits, loss and every gradient against one process for each call in RAGGED, in train then eval
    mode, after capture at CAPTURE; the FallbackWarnings those calls raised; whether any parameter's
    stored layout (placements and local block) changed."""
    model, make = _model(family)
    ref = copy.deepcopy(model)
    args, kwargs = make(*CAPTURE, 1)
    pm = autopar.parallelize(model, grid=grid, example_inputs=args, example_kwargs=kwargs, **options)
    stored = {n: (p.placements, tuple(p.to_local().shape)) for n, p in pm.named_parameters()}
    ref_params = dict(ref.named_parameters())
    errs, warned = {}, []
    for training in (True, False):
        pm.train(training)
        ref.train(training)
        for b, s in RAGGED:
            tag = f"{'train' if training else 'eval'} {b}x{s}"
            args, kwargs = make(b, s, 7 + b + s)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                got_loss, got_logits = _loss_and_logits(pm(*args, **kwargs))
            warned += [f"{tag}: {w.message}" for w in caught if issubclass(w.category, autopar.FallbackWarning)]
            want_loss, want_logits = _loss_and_logits(ref(*args, **kwargs))
            errs.update(group_excess({f"{tag} logits": (got_logits, want_logits)}))
            errs.update(group_excess({f"{tag} loss": (got_loss, want_loss)}))
            got_loss.backward()
            want_loss.backward()
            errs.update(group_excess({n: (p.grad.full_tensor(), ref_params[n].grad)
                                      for n, p in pm.named_parameters()}, prefix=f"{tag} grad "))
            pm.zero_grad()
            ref.zero_grad()
    moved = [n for n, p in pm.named_parameters() if stored[n] != (p.placements, tuple(p.to_local().shape))]
    return {"excess": errs, "warned": warned, "moved": moved, "compiles": len(pm.programs)}


def new_parameter_refused(rank):
    """The error a recompile gives for a parameter the parallelized model did not have: it names the
    parameter and says what to do. (A parameter created during a call is the one case pinned layouts
    cannot serve; here the model gets one after parallelize, before a call of new shapes recompiles.)"""
    model, make = _model("tiny")
    args, kwargs = make(*CAPTURE, 1)
    up = model.blocks[0].mlp.up
    bias, up.bias = up.bias, None
    pm = autopar.parallelize(model, grid=(2, 2), example_inputs=args)
    up.bias = bias
    try:
        pm(*make(3, 7, 2)[0])
    except NotImplementedError as e:
        return str(e)
    return ""
