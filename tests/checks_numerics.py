"""Rank-side checks for numbers one process would not produce: non-finite values that masked-out work
must not spread (embedding rows no id uses, logits at ignored positions, a vocabulary column masked
to -inf) and norms over inputs of extreme magnitude. Each returns plain data; the tests assert on it.

Every comparison is with the unmodified model on one process. The norm checks also run that model in
float64 on the same (fp32-representable) inputs: the distance of the fp32 single process from it
is the most that the parallel run can be asked to reproduce it to.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar
from tests.compare import excess, scaled_atol

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _grads(model) -> dict:
    return {n: _full(p.grad) for n, p in model.named_parameters() if p.grad is not None}


def _pairs_excess(got: dict, want: dict, rtol: float, frac: float, slack: dict | None = None) -> dict:
    """{name: excess} with one atol per group (`frac` x the largest reference value), plus the
    element-wise `slack` of a name (a reference's own error) where given."""
    atol = scaled_atol(want.values(), frac)
    out = {}
    for name, w in want.items():
        extra = 0.0 if slack is None else slack[name]
        out[name] = excess(got[name], w, rtol, atol + extra) if name in got else float("inf")
    return out


class NormNet(nn.Module):
    """x * gain + shift -> LayerNorm or RMSNorm -> Linear. gain = 1 and shift = 0 at the start, so the
    norm sees the input bits exactly in every run (fp32, float64 and the grid alike), and their
    gradients carry the norm's input gradient."""

    def __init__(self, norm: str, hidden: int = 32):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(hidden))
        self.shift = nn.Parameter(torch.zeros(hidden))
        self.norm = nn.LayerNorm(hidden) if norm == "layer" else nn.RMSNorm(hidden, eps=1e-6)
        self.down = nn.Linear(hidden, 8)
        with torch.no_grad():  # generic affine parameters: their gradients then depend on every part
            self.norm.weight.normal_(1.0, 0.5)
            if norm == "layer":
                self.norm.bias.normal_(0.0, 0.5)

    def forward(self, x):
        return self.down(self.norm(x * self.gain + self.shift))  # [b, s, 8]


def _norm_run(model, x, gy):
    out = _full(model(x))
    (out * gy.to(out.dtype)).sum().backward()
    return {"out": out.detach(), **{f"grad {n}": g for n, g in _grads(model).items()}}


def norm_parity(rank, grid, norm, scale, offset=0.0, dtype="float32", rtol=1e-4, frac=1e-5) -> dict:
    """NormNet with inputs of magnitude `scale` around a mean `offset` on `grid` against one
    process (same dtype) and against float64. Returns, by tensor (output and every gradient):
    'single': excess over the fp32 single process, allowing that process's own error vs float64;
    'exact': excess over float64; 'own': the single process's own error vs float64, as an excess."""
    torch.manual_seed(0)
    model = NormNet(norm)
    x = torch.randn(8, 4, 32) * scale + offset
    gy = torch.randn(8, 4, 8)
    exact = _norm_run(copy.deepcopy(model).double(), x.to(DTYPES[dtype]).double(), gy.double())
    model = model.to(DTYPES[dtype])
    x = x.to(DTYPES[dtype])
    single = _norm_run(copy.deepcopy(model), x, gy)
    pm = autopar.parallelize(model, grid=tuple(grid), example_inputs=(x,))
    got = _norm_run(pm, x, gy)
    slack = {n: float((single[n].double() - exact[n]).abs().max()) for n in single}
    return {"single": _pairs_excess(got, single, rtol, frac, slack),
            "exact": _pairs_excess(got, exact, rtol, frac),
            "own": _pairs_excess(single, exact, rtol, frac)}


FAULTS = (float("inf"), float("-inf"), float("nan"))


def _poison_rows(table: torch.Tensor, rows) -> None:
    """Put +inf, -inf and NaN into the given rows of an embedding table, in turn (whole rows)."""
    with torch.no_grad():
        for i, row in enumerate(rows):
            table[row] = FAULTS[i % len(FAULTS)]


def _lm_case(name: str):
    """(model, call kwargs, poisoned table) for a model whose embedding rows from `unused` on are
    never looked up; the logits head never reads those rows either, so one process stays finite."""
    from models import GPTConfig, TinyGPT

    from tests.checks_hf import build

    g = torch.Generator().manual_seed(3)
    if name == "tinygpt":  # learned positions [16, h]: a sequence of 8 never reads rows 8..15
        model = TinyGPT(GPTConfig(vocab_size=64, max_seq=16, hidden=32, heads=4, layers=2))
        ids = torch.randint(0, 64, (4, 8), generator=g)
        return model, dict(ids=ids, targets=torch.randint(0, 64, (4, 8), generator=g)), model.pos.weight, 8
    model, _ = build(name)
    labels = torch.randint(1, 64, (4, 8), generator=g)
    labels[:, ::3] = -100
    if name == "gpt2":  # wte is tied to the head; wpe [64, h]: rows 8..63 are positions never reached
        return model, dict(input_ids=torch.randint(1, 64, (4, 8), generator=g), labels=labels), \
            model.transformer.wpe.weight, 8
    # llama: embed_tokens is not tied; ids below 32 leave the second vocab block (rows 32..63) unread
    return model, dict(input_ids=torch.randint(1, 32, (4, 8), generator=g), labels=labels), \
        model.model.embed_tokens.weight, 32


def _logits_loss(out):
    if isinstance(out, tuple):  # TinyGPT: (logits, loss)
        return _full(out[0]), out[1]
    return _full(out.logits), out.loss


def poisoned_embedding(rank, name, grid=(2, 2)):
    """+inf, -inf and NaN in every embedding row that no id reaches (each vocab block's first local
    row among them), against one process: logits, loss and every gradient, which must all be
    finite there. Returns {'excess': {name: excess}, 'ref_finite': bool}."""
    torch.manual_seed(0)
    model, kw, table, unused = _lm_case(name)
    model.eval()  # no dropout: both runs compute the same function
    _poison_rows(table, range(unused, table.shape[0]))
    ref = copy.deepcopy(model)
    pm = autopar.parallelize(model, grid=tuple(grid), example_kwargs=kw)
    got_logits, got_loss = _logits_loss(pm(**kw))
    want_logits, want_loss = _logits_loss(ref(**kw))
    got_loss.backward()
    want_loss.backward()
    got, want = _grads(pm), _grads(ref)
    ref_finite = all(bool(torch.isfinite(t).all()) for t in [want_logits, want_loss, *want.values()])
    errs = {"logits": excess(got_logits, want_logits, 1e-4, scaled_atol([want_logits])),
            "loss": excess(got_loss, want_loss, 1e-4)}
    errs.update(_pairs_excess({f"grad {n}": t for n, t in got.items()}, {f"grad {n}": t for n, t in want.items()},
                              1e-4, 1e-5))
    return {"excess": errs, "ref_finite": ref_finite}


class FaultyHead(nn.Module):
    """Linear -> GELU -> Linear to logits, plus an additive `fault` [b, s, V] (zeros, with +-inf or
    NaN where a test puts them) before the cross-entropy: non-finite logits that reach no
    parameter's forward, so the parameters' gradients are what one process makes of them."""

    def __init__(self, vocab: int = 64, hidden: int = 32, reduction: str = "mean"):
        super().__init__()
        self.up = nn.Linear(16, hidden)
        self.head = nn.Linear(hidden, vocab)
        self.reduction = reduction

    def forward(self, x, targets, fault):
        logits = self.head(F.gelu(self.up(x))) + fault  # [b, s, V]
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1), reduction=self.reduction)


def faulty_logits(rank, kind, reduction="mean", grid=(2, 2)):
    """Cross-entropy against one process with non-finite logits that one process ignores.

    kind 'ignored': at positions whose target is -100, a row with one NaN, a row with one +inf, a
    row of NaN and a row with -inf (one process: finite loss; its logits gradient on those rows is
    what torch's log_softmax backward gives, NaN where the row holds NaN or +inf).
    kind 'masked column': vocabulary entry 32 (the first of the second vocab block) at -inf in
    every row and never a target, plus -inf rows at ignored positions (one process: all finite).
    Returns {'excess': {name: excess}, 'ref_loss_finite': bool, 'ref_grads_finite': bool}."""
    torch.manual_seed(0)
    b, s, V = 4, 8, 64
    model = FaultyHead(V, reduction=reduction)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(b, s, 16, generator=g)
    targets = torch.randint(0, V, (b, s), generator=g)
    fault = torch.zeros(b, s, V)
    if kind == "ignored":
        for i, (row, col, value) in enumerate([(0, 5, "nan"), (1, 40, "inf"), (2, None, "nan"), (3, 33, "-inf")]):
            targets[row, 2 * i + 1] = -100
            fault[row, 2 * i + 1, slice(None) if col is None else col] = float(value)
    else:
        targets[targets == 32] = 31
        fault[:, :, 32] = float("-inf")
        targets[:, 3] = -100
        fault[:, 3, :7] = float("-inf")
    ref = copy.deepcopy(model)
    pm = autopar.parallelize(model, grid=tuple(grid), example_inputs=(x, targets, fault))
    got_fault, want_fault = fault.clone().requires_grad_(), fault.clone().requires_grad_()
    got_loss, want_loss = pm(x, targets, got_fault), ref(x, targets, want_fault)
    got_loss.backward()
    want_loss.backward()
    got = {**_grads(pm), "logits": got_fault.grad}  # d loss / d fault = d loss / d logits
    want = {**_grads(ref), "logits": want_fault.grad}
    errs = {"loss": excess(got_loss, want_loss, 1e-4)}
    errs.update(_pairs_excess({f"grad {n}": t for n, t in got.items()}, {f"grad {n}": t for n, t in want.items()},
                              1e-4, 1e-5))
    return {"excess": errs, "ref_loss_finite": bool(torch.isfinite(want_loss)),
            "ref_grads_finite": all(bool(torch.isfinite(t).all()) for t in want.values())}


def norm_parity_cases(rank, grid, cases) -> dict:
    """norm_parity for each (norm, scale, offset, dtype, rtol, frac) in `cases`, by case name, as one
    dict {name: excess}: 'vs one process' (allowing its own error vs float64) and 'vs float64' as a
    ratio to what the one process achieves (at least fp32 rounding: max(1, 2 x its excess))."""
    out = {}
    for norm, scale, offset, dtype, rtol, frac in cases:
        r = norm_parity(rank, grid, norm, scale, offset, dtype, rtol, frac)
        case = f"{norm} |x|~{scale:g}+{offset:g} {dtype}"
        for name, v in r["single"].items():
            out[f"{case} vs one process: {name}"] = v
        for name, v in r["exact"].items():
            out[f"{case} vs float64: {name}"] = v / max(1.0, 2.0 * r["own"][name])
    return out
