"""Rank-side checks for losses the user computes on a ParallelModule's outputs, and for output dtypes
under autocast. Each returns plain data (excess per compared tensor, bytes, dtypes) for the test."""

from __future__ import annotations

import contextlib
import copy
import warnings
from unittest import mock

import torch
import torch.nn.functional as F
import torch.distributed._functional_collectives as funcol

import autopar
from autopar.program.outputs import LOSS_TAG, Output
from tests.checks_hf import build
from tests.compare import group_excess


@contextlib.contextmanager
def dtensor_collectives():
    """DTensor's own collectives (its functional ones) while inside, as [(name, bytes received per
    rank under CommLog's conventions)]. Counted where DTensor calls them, since a dispatch mode does not
    see what runs inside a tensor subclass's dispatch."""
    seen = []

    def counted(name, fn, received):
        def call(t, *args, **kwargs):
            group = args[-1] if args else kwargs.get("group")
            q = group[0].size(group[1]) if isinstance(group, tuple) else funcol._resolve_group(group).size()
            seen.append((name, received(q, t.numel() * t.element_size())))
            return fn(t, *args, **kwargs)
        return call

    ring = {"all_reduce": lambda q, n: 2 * (q - 1) * n // q, "all_gather_single": lambda q, n: (q - 1) * n,
            "reduce_scatter_single": lambda q, n: (q - 1) * n // q}
    with contextlib.ExitStack() as stack:
        for name, received in ring.items():
            stack.enter_context(mock.patch.object(funcol, name, counted(name, getattr(funcol, name), received)))
        yield seen


def _grads(pm, ref, tag):
    ref_params = dict(ref.named_parameters())
    return group_excess({n: (p.grad.full_tensor(), ref_params[n].grad) for n, p in pm.named_parameters()},
                        prefix=f"{tag} grad ")


def _step(pm, ref, run_model, loss_fn, tag):
    """One loss on the outputs of both models, backward; excess of the loss and of every gradient, the
    bytes the loss moved (autopar's CommLog and DTensor's collectives) and the loss's type."""
    got_out, want_out = run_model(pm), run_model(ref)
    pm.grid.log.reset()
    with dtensor_collectives() as seen:
        loss = loss_fn(got_out)
        loss.backward()
    want = loss_fn(want_out)
    want.backward()
    errs = group_excess({f"{tag} loss": (loss, want)})
    errs.update(_grads(pm, ref, tag))
    pm.zero_grad()
    ref.zero_grad()
    facts = dict(bytes=pm.grid.log.total(LOSS_TAG), dtensor_collectives=seen, plain=type(loss) is torch.Tensor,
                 output_type=type(got_out if isinstance(got_out, torch.Tensor) else got_out.logits).__name__)
    return errs, facts


def _parallel(model, grid, **kw):
    ref = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", autopar.FallbackWarning)
        pm = autopar.parallelize(model, grid=grid, **kw)
    return pm, ref


def mse_on_repo_model(rank, grid):
    """TinyGPT's logits against a plain random target: mse (mean, sum), l1 and smooth_l1."""
    from models import GPTConfig, TinyGPT

    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(layers=1))
    ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(1))
    y = torch.randn(4, 8, 64, generator=torch.Generator().manual_seed(2))
    pm, ref = _parallel(model, grid, example_inputs=(ids,))
    cases = {
        "mse mean": lambda out: F.mse_loss(out, y),
        "mse sum": lambda out: F.mse_loss(out, y, reduction="sum"),
        "l1": lambda out: F.l1_loss(out, y),
        "smooth_l1": lambda out: F.smooth_l1_loss(out[:, 1:], y[:, 1:], beta=0.5),
    }
    errs, facts = {}, {}
    for tag, fn in cases.items():
        e, facts[tag] = _step(pm, ref, lambda m: m(ids), fn, tag)
        errs.update(e)
    return dict(excess=errs, facts=facts)


def _labels(batch, seq, seed):
    labels = torch.randint(0, 64, (batch, seq), generator=torch.Generator().manual_seed(seed))
    labels[:, ::3] = -100  # positions not predicted
    labels[0, :] = -100  # a row block with fewer counted tokens than the other
    return labels


def ce_on_hf_logits(rank, grid, family="llama"):
    """F.cross_entropy on an HF causal LM's logits (no labels given to the model) with ignore_index=-100
    labels, as users write it: flattened, shifted, through nn.CrossEntropyLoss, summed; and the forms
    that take DTensor's path: class weights, label smoothing, reduction='none'."""
    torch.manual_seed(0)
    model, make = build(family)
    model.eval()
    ids = make(4, 8, 1)["input_ids"]
    labels = _labels(4, 8, 5)
    weight = torch.rand(64, generator=torch.Generator().manual_seed(3)) + 0.5
    pm, ref = _parallel(model, grid, example_kwargs=dict(input_ids=ids))
    cases = {
        "mean": lambda out: F.cross_entropy(out.logits.flatten(0, 1), labels.flatten()),
        "sum": lambda out: F.cross_entropy(out.logits.flatten(0, 1), labels.flatten(), reduction="sum"),
        "shifted": lambda out: torch.nn.CrossEntropyLoss()(out.logits[:, :-1].reshape(-1, 64),
                                                           labels[:, 1:].reshape(-1)),
        "float mean": lambda out: F.cross_entropy(out.logits.float().view(-1, 64), labels.view(-1),
                                                  ignore_index=-100, reduction="mean"),
        "weighted mean": lambda out: F.cross_entropy(out.logits.flatten(0, 1), labels.flatten(), weight=weight),
        "smoothed mean": lambda out: F.cross_entropy(out.logits.flatten(0, 1), labels.flatten(),
                                                     label_smoothing=0.1),
        "none": lambda out: (F.cross_entropy(out.logits.flatten(0, 1), labels.flatten(), reduction="none")
                             * torch.linspace(0.5, 1.5, 32)).sum(),
    }
    errs, facts = {}, {}
    for tag, fn in cases.items():
        e, facts[tag] = _step(pm, ref, lambda m: m(input_ids=ids), fn, tag)
        errs.update(e)
    try:
        F.cross_entropy(pm(input_ids=ids).logits.flatten(0, 1), torch.full((32,), 64))
        bad = "no error"
    except ValueError as err:
        bad = str(err)
    return dict(excess=errs, facts=facts, bad_target=bad)


def _dtypes(out):
    return {k: (v.dtype if isinstance(v, torch.Tensor) else [h.dtype for h in v]) for k, v in out.items()
            if k in ("loss", "logits", "hidden_states")}


BF16_RTOL = 2e-2  # bf16 keeps 8 mantissa bits (2^-8 = 3.9e-3 per rounding); a few roundings apart
BF16_ATOL_FRAC = 2e-2  # of the largest reference value of the group


def autocast_dtypes(rank, grid):
    """Under torch.autocast(bf16): the HF Llama's logits, hidden states and loss have the single
    process's dtypes, their values within bf16 tolerance, and the user's own cross_entropy on the
    logits comes back fp32 as torch's does under autocast; gradients within bf16 tolerance."""
    torch.manual_seed(0)
    model, make = build("llama")
    model.eval()
    kw = make(4, 8, 1)
    pm, ref = _parallel(model, grid, example_kwargs=kw)
    labels = _labels(4, 8, 5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        same = pm(**kw)  # the keywords parallelize captured with, now under autocast
        got = pm(**kw, output_hidden_states=True)
        want = ref(**kw, output_hidden_states=True, use_cache=False)
        own = F.cross_entropy(got.logits.flatten(0, 1), labels.flatten())
        own_want = F.cross_entropy(want.logits.flatten(0, 1), labels.flatten())
    pairs = {"logits": (got.logits.full_tensor(), want.logits), "loss": (got.loss, want.loss),
             "logits, capture's keywords": (same.logits.full_tensor(), want.logits),
             "own loss": (own, own_want)}
    pairs.update({f"hidden {i}": (h.full_tensor(), w) for i, (h, w) in enumerate(zip(got.hidden_states,
                                                                                     want.hidden_states))})
    errs = {}
    for name, pair in pairs.items():
        errs.update(group_excess({name: pair}, rtol=BF16_RTOL, frac=BF16_ATOL_FRAC))
    (got.loss + own).backward()
    (want.loss + own_want).backward()
    ref_params = dict(ref.named_parameters())
    errs.update(group_excess({n: (p.grad.full_tensor(), ref_params[n].grad) for n, p in pm.named_parameters()},
                             rtol=BF16_RTOL, frac=BF16_ATOL_FRAC, prefix="grad "))
    dtypes = dict(got=_dtypes(got), want=_dtypes(want), own=(own.dtype, own_want.dtype),
                  same=(same.logits.dtype, same.loss.dtype))
    return dict(excess=errs, dtypes=dtypes, output_type=type(got.logits) is Output)
