"""Rank-side checks for transformers models built from their config classes (tiny sizes, random
weights; nothing is downloaded). Each returns plain data for the test to assert on."""

from __future__ import annotations

import copy
import warnings

import torch

import autopar
from tests.compare import excess, group_excess

VOCAB = 64


def _ids(batch, seq, seed, low=1, high=VOCAB):
    return torch.randint(low, high, (batch, seq), generator=torch.Generator().manual_seed(seed))


def build(family: str, **over):
    """(model, kwargs-maker) for a family; kwargs-maker(batch, seq, seed) gives one call's inputs. One
    block of hidden 32 unless a family says otherwise: a block's every path runs in one, and a second
    doubles capture and steps for no new layout."""
    import transformers as T

    tok = dict(pad_token_id=0, bos_token_id=0, eos_token_id=0)
    dec = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
               intermediate_size=64, max_position_embeddings=64, **tok)

    def lm(b, s, seed):
        return dict(input_ids=_ids(b, s, seed), labels=_ids(b, s, seed + 100))

    if family == "gpt2":
        cfg = dict(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=4, n_positions=64, **tok)
        cfg.update(over)
        return T.GPT2LMHeadModel(T.GPT2Config(**cfg)), lm
    if family == "llama":
        return T.LlamaForCausalLM(T.LlamaConfig(**{**dec, "num_key_value_heads": 2, **over})), lm
    if family == "mistral":  # one KV head: fewer KV heads than grid columns
        return T.MistralForCausalLM(T.MistralConfig(**{**dec, "num_key_value_heads": 1, **over})), lm
    if family == "qwen2":  # q/k/v projections with bias
        return T.Qwen2ForCausalLM(T.Qwen2Config(**{**dec, "num_key_value_heads": 2, **over})), lm
    if family == "falcon":  # multi-query: one KV head in a fused query_key_value used through `.T`
        # two blocks: test_rules_gqa_index's byte figures are of two
        cfg = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, **tok)
        return T.FalconForCausalLM(T.FalconConfig(**{**cfg, "multi_query": True, **over})), lm
    if family == "gpt_bigcode":  # multi-query in a fused c_attn
        cfg = dict(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=4, n_positions=64, **tok)
        return T.GPTBigCodeForCausalLM(T.GPTBigCodeConfig(**{**cfg, "multi_query": True, **over})), lm
    if family == "opt":
        cfg = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, ffn_dim=64, num_attention_heads=4,
                   max_position_embeddings=64, word_embed_proj_dim=32, **tok)
        return T.OPTForCausalLM(T.OPTConfig(**{**cfg, **over})), lm
    if family == "bert":
        cfg = {k: v for k, v in dec.items() if k not in ("bos_token_id", "eos_token_id")}

        def mlm(b, s, seed):
            mask = torch.ones(b, s, dtype=torch.long)
            mask[0, s // 2:] = 0  # one padded sequence
            labels = _ids(b, s, seed + 100)
            labels[:, ::3] = -100  # positions that are not predicted
            types = torch.zeros(b, s, dtype=torch.long)
            types[:, s // 2:] = 1
            return dict(input_ids=_ids(b, s, seed), attention_mask=mask, token_type_ids=types, labels=labels)

        return T.BertForMaskedLM(T.BertConfig(**{**cfg, **over})), mlm
    if family == "vit":
        # two blocks: at one, the patch embedding and classifier (kept whole) exceed 1.3/p of the parameters
        cfg = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                   image_size=16, patch_size=4, num_labels=4)

        def img(b, s, seed):
            g = torch.Generator().manual_seed(seed)
            return dict(pixel_values=torch.randn(b, 3, 16, 16, generator=g),
                        labels=torch.randint(0, 4, (b,), generator=g))

        return T.ViTForImageClassification(T.ViTConfig(**{**cfg, **over})), img
    if family == "t5":
        cfg = dict(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4,
                   decoder_start_token_id=0, pad_token_id=0, eos_token_id=0)

        def seq2seq(b, s, seed):
            mask = torch.ones(b, s, dtype=torch.long)
            mask[-1, -2:] = 0
            return dict(input_ids=_ids(b, s, seed), attention_mask=mask, labels=_ids(b, s // 2, seed + 100))

        return T.T5ForConditionalGeneration(T.T5Config(**{**cfg, **over})), seq2seq
    raise ValueError(family)


def _out_tensor(x):
    return x.full_tensor() if hasattr(x, "full_tensor") else x


def hf_parity(rank, family, over=None, batch=4, seq=8, other_shape=(8, 12), extra=None, grid=(2, 2), options=None):
    """Logits, the HF loss and every gradient against the unmodified model on one process; then the
    same at another batch size and sequence length (`other_shape`; None: the first shape only);
    placement facts for the memory table. `extra`
    kwargs go to every call (e.g. the Trainer's num_items_in_batch, which makes HF sum the loss);
    `options` go to parallelize (strategy=..., cost_model=...)."""
    torch.manual_seed(0)
    model, base_make = build(family, **(over or {}))

    def make(b, s, seed):
        return {**base_make(b, s, seed), **(extra or {})}

    model.eval()  # dropout off: the single process and the grid then compute the same function
    ref = copy.deepcopy(model)
    kw = make(batch, seq, 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pm = autopar.parallelize(model, grid=grid, example_kwargs=kw, **(options or {}))
    warned = [str(w.message) for w in caught if issubclass(w.category, autopar.FallbackWarning)]
    ref_params = dict(ref.named_parameters())
    # the DTensors are the original matrices (fused ones included), moved not computed: bit equality
    errs = {f"state dict {n}": excess(p.full_tensor(), ref_params[n], 0.0, 0.0) for n, p in pm.named_parameters()}
    shapes = (("", (batch, seq)),) + (((" other shape", other_shape),) if other_shape else ())
    for tag, (b, s) in shapes:
        kw = make(b, s, 7 if tag else 1)
        out, want = pm(**kw), ref(**kw)
        errs.update(group_excess({f"logits{tag}": (_out_tensor(out.logits), want.logits)}))
        errs.update(group_excess({f"loss{tag}": (_out_tensor(out.loss), want.loss)}))
        out.loss.backward()
        want.loss.backward()
        errs.update(group_excess({n: (p.grad.full_tensor(), ref_params[n].grad) for n, p in pm.named_parameters()},
                                 prefix=f"grad{tag} "))
        pm.zero_grad()
        ref.zero_grad()
    unsplit = [n for n, p in pm.named_parameters()
               if p.dim() == 2 and all(d % 2 == 0 for d in p.shape)
               and any(str(pl) == "Replicate()" for pl in p.placements)]
    held = sum(p.to_local().numel() for p in pm.parameters())
    held_bytes = sum(p.to_local().numel() * p.element_size() for p in pm.parameters())
    full = sum(p.numel() for p in pm.parameters())
    choice = pm.choice
    return {"excess": errs, "warned": warned, "unsplit_2d": unsplit, "fraction": held * 4 / full,
            "held_bytes": held_bytes,
            "explain": autopar.explain(pm, verbose=True) if rank == 0 else "",
            "assignment": choice.assignment if choice is not None else None}


def hf_modes_and_cache(rank):
    """train()/eval() switching with dropout, and the KV-cache refusal."""
    torch.manual_seed(0)
    model, make = build("gpt2", resid_pdrop=0.3, embd_pdrop=0.3, attn_pdrop=0.3)
    kw = make(4, 8, 1)
    pm = autopar.parallelize(model, grid=(2, 2), example_kwargs=kw)  # model is in train mode
    res = {}
    torch.manual_seed(1)
    train_a = _out_tensor(pm(**kw).logits)
    torch.manual_seed(2)
    train_b = _out_tensor(pm(**kw).logits)
    res["train masks differ"] = (train_a - train_b).abs().max().item()
    pm.eval()
    model.eval()
    res["eval parity"] = group_excess({"eval logits": (_out_tensor(pm(**kw).logits), model(**kw).logits)})
    res["config use_cache kept"] = bool(model.config.use_cache)
    try:
        pm(**kw, use_cache=True)
        res["cache error"] = ""
    except ValueError as e:
        res["cache error"] = str(e)
    return res
