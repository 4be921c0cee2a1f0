"""Rank-side checks for models whose forward holds no_grad regions or in-place ops (see
test_capture_regions.py). Each returns plain data (per-name excess from tests/compare.py) for the test
to assert on."""

from __future__ import annotations

import copy
import warnings

import torch
import torch.nn as nn

import autopar
from tests.compare import RTOL, excess, scaled_atol

VOCAB = 64


class EMANet(nn.Module):
    """Keeps a running mean of its hidden activations in a buffer, updated under no_grad in forward."""

    def __init__(self, width=8, hidden=16):
        super().__init__()
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)
        self.register_buffer("ema", torch.zeros(hidden))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        h = torch.relu(self.up(x))  # [b, hidden]
        with torch.no_grad():
            self.ema.mul_(0.9).add_(h.mean(0), alpha=0.1)
            self.steps.add_(1)
        return self.down(h + self.ema)  # the updated buffer feeds the output (as a constant)


class ShrinkNet(nn.Module):
    """Decays its own weight in place under no_grad before using it (weight-decay-in-forward)."""

    def __init__(self, width=8, hidden=16):
        super().__init__()
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)

    def forward(self, x):
        with torch.no_grad():
            self.up.weight.mul_(0.99)
            self.up.bias.add_(0.01)
        return self.down(torch.tanh(self.up(x)))


class InplaceNet(nn.Module):
    """In-place ops on a partial sum (a sum over the column-split hidden dim) and on split activations:
    add_, mul_, masked_fill_ and a chain of two."""

    def __init__(self, width=8, hidden=16):
        super().__init__()
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width, bias=False)
        self.emb = nn.Embedding(VOCAB, width)

    def forward(self, ids, x):
        e = self.emb(ids)  # [b, width]
        e *= 2.0
        e += x
        h = self.up(e)  # [b/R, hidden/C]
        s = h.sum(-1, keepdim=True)  # [b/R, 1], a partial sum over the columns
        s *= 0.5
        s += h.mean(-1, keepdim=True)
        h.mul_(0.5).add_(s)
        h.masked_fill_(h > 1.2, 0.0)
        y = self.down(torch.tanh(h))
        y.add_(e)
        return y


def build(family: str):
    """(model, kwargs-maker) for a transformers family from a tiny config; kwargs-maker(b, s, seed)."""
    import transformers as T

    tok = dict(pad_token_id=0, bos_token_id=0, eos_token_id=0)
    enc = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
               intermediate_size=64, max_position_embeddings=64, pad_token_id=0)

    def ids(b, s, seed):
        return torch.randint(1, VOCAB, (b, s), generator=torch.Generator().manual_seed(seed))

    def lm(b, s, seed):
        return dict(input_ids=ids(b, s, seed), labels=ids(b, s, seed + 100))

    def mlm(b, s, seed):
        labels = ids(b, s, seed + 100)
        labels[:, ::3] = -100
        mask = torch.ones(b, s, dtype=torch.long)
        mask[0, s // 2:] = 0
        return dict(input_ids=ids(b, s, seed), attention_mask=mask, labels=labels)

    if family == "megatron_bert":
        return T.MegatronBertForMaskedLM(T.MegatronBertConfig(**enc)), mlm
    if family == "ctrl":
        cfg = T.CTRLConfig(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, dff=64, n_positions=64, **tok)
        return T.CTRLLMHeadModel(cfg), lm
    if family == "deberta_v2":
        return T.DebertaV2ForMaskedLM(T.DebertaV2Config(**enc, relative_attention=True, position_buckets=8,
                                                        pos_att_type=["p2c", "c2p"])), mlm
    if family == "phimoe":
        cfg = T.PhimoeConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64,
                             num_local_experts=4, num_experts_per_tok=2, **tok)
        return T.PhimoeForCausalLM(cfg), lm
    raise ValueError(family)


def _full(x):
    return x.full_tensor() if hasattr(x, "full_tensor") else x


def _compare_step(out, want, grads, ref_grads, tag) -> dict:
    """Excess of each output and gradient against the reference; atol scaled to the group's magnitude."""
    errs = {}
    out_atol = scaled_atol(want.values())
    for k in want:
        errs[f"{tag}{k}"] = excess(_full(out[k]), want[k], RTOL, out_atol)
    grad_atol = scaled_atol(ref_grads.values())
    for k in ref_grads:
        errs[f"{tag}grad {k}"] = excess(grads[k], ref_grads[k], RTOL, grad_atol)
    return errs


def module_parity(rank, name, grid=(2, 2), batch=4, steps=2):
    """A small nn.Module: outputs, every gradient, every buffer and every parameter after `steps` SGD
    steps against the unmodified model on one process."""
    torch.manual_seed(0)
    model = {"ema": EMANet, "shrink": ShrinkNet, "inplace": InplaceNet}[name]()
    ref = copy.deepcopy(model)
    pm = autopar.parallelize(model, grid=grid, example_inputs=_inputs(name, batch, 0))
    opt = torch.optim.SGD(pm.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    errs = {}
    for step in range(steps):
        args = _inputs(name, batch, step + 1)
        out, want = pm(*args), ref(*args)
        (_full(out) ** 2).sum().backward()
        (want ** 2).sum().backward()
        grads = {n: p.grad.full_tensor() for n, p in pm.named_parameters()}
        ref_grads = {n: p.grad for n, p in ref.named_parameters()}
        errs.update(_compare_step({"out": out}, {"out": want.detach()}, grads, ref_grads, f"step {step} "))
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    ref_state = dict(ref.state_dict())
    for n, t in pm.state_dict().items():
        errs[f"after {steps} steps {n}"] = excess(_full(t).double(), ref_state[n].double(), RTOL, 1e-7)
    return errs


def _inputs(name, batch, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 8, generator=g)
    if name == "inplace":
        return torch.randint(0, VOCAB, (batch,), generator=g), x
    return (x,)


def hf_parity(rank, family, batch=4, seq=8, grid=(2, 2)):
    """Logits, loss and every gradient of a transformers family against the unmodified model on one
    process (eval mode: dropout off), on this rank; the FallbackWarning texts too."""
    torch.manual_seed(0)
    model, make = build(family)
    model.eval()
    ref = copy.deepcopy(model)
    kw = make(batch, seq, 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pm = autopar.parallelize(model, grid=grid, example_kwargs=kw)
    warned = [str(w.message) for w in caught if issubclass(w.category, autopar.FallbackWarning)]
    out, want = pm(**kw), ref(**kw)
    out.loss.backward()
    want.loss.backward()
    grads = {n: p.grad.full_tensor() for n, p in pm.named_parameters() if p.grad is not None}
    ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    errs = _compare_step({"logits": out.logits, "loss": out.loss},
                         {"logits": want.logits.detach(), "loss": want.loss.detach()}, grads, ref_grads, "")
    errs["gradient names"] = 0.0 if sorted(grads) == sorted(ref_grads) else float("inf")
    return {"errs": errs, "warned": warned}
