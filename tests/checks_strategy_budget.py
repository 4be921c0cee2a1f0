"""Rank-side check for test_strategy_budget.py: an encoder-decoder (BART) planned with strategy='auto'
against the unmodified model on one process."""

from __future__ import annotations

import copy

import torch

import autopar
from tests.compare import group_excess

CPU = {  # the gloo-like alpha-beta model of test_strategy.py: it makes the search mix 2d, 1d and rep
    "version": 1, "source": "test", "grid": [2, 2], "backend": "gloo", "device": "cpu",
    "axes": [{"alpha_s": 2e-4, "beta_bytes_per_s": 2e9, "points": []},
             {"alpha_s": 2e-4, "beta_bytes_per_s": 2e9, "points": []}],
    "flops_per_s": 3e10, "when": "test",
}
VOCAB = 64


def bart(layers: int = 2, meta: bool = False):
    """A tiny BART (vocabulary 64, hidden 32, `layers` encoder and decoder layers) and one call's kwargs."""
    import transformers as T

    cfg = T.BartConfig(vocab_size=VOCAB, d_model=32, encoder_layers=layers, decoder_layers=layers,
                       encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
                       max_position_embeddings=64, use_cache=False, pad_token_id=0, bos_token_id=0, eos_token_id=0,
                       decoder_start_token_id=0)
    g = torch.Generator().manual_seed(0)
    kw = dict(input_ids=torch.randint(1, VOCAB, (4, 8), generator=g),
              labels=torch.randint(1, VOCAB, (4, 4), generator=g))
    if meta:
        with autopar.meta_init():
            return T.BartForConditionalGeneration(cfg), kw
    return T.BartForConditionalGeneration(cfg), kw


def bart_auto_parity(rank) -> dict:
    """Logits, loss and every parameter gradient of BART parallelized with strategy='auto' on 2x2,
    as {name: excess} (tests/compare.py), and the assignment the search chose."""
    torch.manual_seed(0)
    model, kw = bart()
    model.eval()  # dropout off: one process and the grid compute the same function
    ref = copy.deepcopy(model)
    # the default search_budget: rank 0 searches and sends its choice, so every rank runs one plan
    pm = autopar.parallelize(model, grid=(2, 2), example_kwargs=kw, strategy="auto", cost_model=CPU)
    out, want = pm(**kw), ref(**kw)
    logits = out.logits.full_tensor() if hasattr(out.logits, "full_tensor") else out.logits
    out.loss.backward()
    want.loss.backward()
    ref_params = dict(ref.named_parameters())
    grads = {n: (p.grad.full_tensor(), ref_params[n].grad) for n, p in pm.named_parameters()}
    errs = {**group_excess({"logits": (logits, want.logits)}), **group_excess({"loss": (out.loss, want.loss)}),
            **group_excess(grads, prefix="grad ")}
    choice = pm.choice
    return {"errs": errs, "assignment": choice.assignment, "complete": choice.complete}
