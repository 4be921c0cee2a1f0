"""Rank-side checks of `autopar.verify`: bugs injected through the rule registry and into a collective's
backward, each restored before the check returns (the pool's processes are reused)."""

from __future__ import annotations

import warnings

import torch
import torch.nn as nn

import autopar
from models import GPTConfig, TinyGPT
from passes.layout import REPLICATED
from passes.ops import comm
from passes.rules.registry import RULES, Strategy

aten = torch.ops.aten


class SoftMLP(nn.Module):
    """A softmax over the hidden features between two linears: under 2D the features are split over the
    grid's columns, so the softmax needs them whole."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 16)

    def forward(self, x):
        h = torch.softmax(self.fc1(x), dim=-1)
        return self.fc2(h)


def _softmax_on_blocks(node, layouts, mesh):
    """A wrong rule: the softmax run on each block as it is (a per-block normalisation)."""
    x = node.args[0]
    lay = layouts[x] or REPLICATED
    return Strategy({x: lay}, lay)


def _summary(report) -> dict:
    d = report.divergence
    return {"ok": report.ok, "text": str(report), "nodes": report.nodes,
            "mismatched": sorted({f.category for f in report.mismatches}),
            "worst": {k: f.error for k, f in report.worst().items()},
            "divergence": None if d is None else {
                "direction": d.direction, "node": d.node, "op": d.op, "source": d.source, "layout": d.layout,
                "inputs": d.inputs, "users": d.users, "module": d.module}}


def wrong_rule(rank) -> dict:
    """SoftMLP on 2x2 with the right softmax rule, then with `_softmax_on_blocks` registered in its place."""
    torch.manual_seed(0)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))

    def loss(out):
        return out.float().pow(2).mean()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = {"right": _summary(autopar.verify(SoftMLP(), (x,), grid=(2, 2), loss=loss))}
        saved = {op: RULES[op] for op in (aten._softmax.default, aten.softmax.int)}
        try:
            RULES.update({op: _softmax_on_blocks for op in saved})
            torch.manual_seed(0)
            out["wrong"] = _summary(autopar.verify(SoftMLP(), (x,), grid=(2, 2), loss=loss))
        finally:
            RULES.update(saved)
    return out


def _tiny(layers=1):
    torch.manual_seed(0)
    cfg = GPTConfig(layers=layers)
    ids = torch.randint(0, cfg.vocab_size, (4, 8), generator=torch.Generator().manual_seed(1))
    return TinyGPT(cfg), (ids, ids)


def backward_bug(rank) -> dict:
    """TinyGPT under 1D (sequence-parallel gathers whose backward reduce-scatters) with that reduce-scatter's
    result doubled: the forward is right, the backward wrong."""
    model, args = _tiny()
    was = comm.GatherSum.backward

    def doubled(ctx, g):
        out = was(ctx, g)
        return (out[0] * 2, *out[1:])

    comm.GatherSum.backward = staticmethod(doubled)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return _summary(autopar.verify(model, args, grid=(2, 2), strategy="1d"))
    finally:
        comm.GatherSum.backward = staticmethod(was)


def clean(rank, layers=1, family="tinygpt", **options) -> dict:
    """TinyGPT (or a transformers `family` of tests.checks_hf.build, dropout off) verified with `options`
    (pipeline=S: S stages), every node compared (nodes='always'), two steps."""
    if isinstance(options.get("pipeline"), int):
        options["pipeline"] = autopar.Pipeline(stages=options["pipeline"])
    kwargs: dict = {}
    if family == "tinygpt":
        model, args = _tiny(layers)
    else:
        from tests.checks_hf import build

        torch.manual_seed(0)
        model, make = build(family, **(dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0) if family == "gpt2"
                                       else {}))
        args, kwargs = (), make(4, 8, 1)
    if options.pop("bf16", False):
        model = model.to(torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _summary(autopar.verify(model, args, kwargs, steps=2, nodes="always", **options))


def refusals(rank) -> dict:
    """What verify says to a model with dropout, to steps=0 and to an unknown `nodes`."""
    out = {}
    torch.manual_seed(0)
    cfg = GPTConfig(layers=1, dropout=0.1)
    ids = torch.randint(0, cfg.vocab_size, (4, 8))
    import autopar.debug.verify as V

    was = V.available_bytes
    V.available_bytes = lambda device: 2**10  # a rank with 1 KiB free: TinyGPT's reference needs 300 KiB
    try:
        autopar.verify(TinyGPT(GPTConfig(layers=1)), (ids, ids))
        out["fits"] = None
    except autopar.UsageError as e:
        out["fits"] = str(e)
    finally:
        V.available_bytes = was
    with torch.device("meta"):
        meta = TinyGPT(GPTConfig(layers=1))
    for name, call in (("meta", lambda: autopar.verify(meta, (ids, ids))),
                       ("dropout", lambda: autopar.verify(TinyGPT(cfg), (ids, ids), grid=(2, 2))),
                       ("steps", lambda: autopar.verify(TinyGPT(cfg), (ids, ids), steps=0)),
                       ("nodes", lambda: autopar.verify(TinyGPT(cfg), (ids, ids), nodes="sometimes"))):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                call()
            out[name] = None
        except autopar.UsageError as e:
            out[name] = str(e)
    return out


def step_report(rank, out) -> dict:
    """Two AdamW steps of TinyGPT on 2x2 recorded by `autopar.report`, and the same two steps of a second
    copy without it: the parameters after both, this rank's trace events, the report's rows; then the
    refusals and the note for fewer steps marked than asked for."""
    def train(report):
        model, args = _tiny()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pm = autopar.parallelize(model, grid=(2, 2), example_inputs=args)
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)

        def step():
            pm(*args)[1].backward()
            opt.step()
            opt.zero_grad()

        rep = None
        if report:
            pm.grid.log.reset()
            with autopar.report(pm, steps=2, out=out) as rep:
                for _ in range(2):
                    step()
                    rep.step()
        else:
            for _ in range(2):
                step()
        return pm, rep

    pm, rep = train(True)
    plain, _ = train(False)
    same = all(torch.equal(p.to_local(), q.to_local()) for p, q in zip(pm.parameters(), plain.parameters()))
    out_ = {"same": same, "rows": rep.rows, "text": str(rep), "files": rep.files, "calls": pm.grid.log.calls(),
            "tags": dict(pm.grid.log.launches)}
    errors = {}
    for name, call in (("steps", lambda: autopar.report(pm, steps=0)), ("model", lambda: autopar.report(object()))):
        try:
            call()
            errors[name] = None
        except autopar.UsageError as e:
            errors[name] = str(e)
    with autopar.report(pm, steps=3, out=None) as few:
        pm(*_tiny()[1])[1].backward()
        few.step()
    errors["few"] = few.notes
    out_["errors"] = errors
    return out_
