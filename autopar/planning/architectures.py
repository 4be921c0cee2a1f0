"""Published model architectures by name (the model cards' figures), for `autopar estimate`, `autopar
plan` and the published record (`autopar.bench.published`): built from their transformers configs on
the meta device, no weights."""

from __future__ import annotations

__all__ = ["MODELS", "published_model"]

_LLAMA3 = dict(model_type="llama", num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0,
               max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False)
_LLAMA2 = dict(model_type="llama", vocab_size=32000, max_position_embeddings=4096, rms_norm_eps=1e-5,
               tie_word_embeddings=False)
MODELS = {  # the published architectures (Llama 3.1 and Llama 2 model cards)
    "llama3-8b": dict(_LLAMA3, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                      num_hidden_layers=32),
    "llama3-70b": dict(_LLAMA3, hidden_size=8192, intermediate_size=28672, num_attention_heads=64,
                       num_hidden_layers=80),
    "llama3-405b": dict(_LLAMA3, hidden_size=16384, intermediate_size=53248, num_attention_heads=128,
                        num_hidden_layers=126),
    "llama2-13b": dict(_LLAMA2, hidden_size=5120, intermediate_size=13824, num_attention_heads=40,
                       num_key_value_heads=40, num_hidden_layers=40),
    "llama2-70b": dict(_LLAMA2, hidden_size=8192, intermediate_size=28672, num_attention_heads=64,
                       num_key_value_heads=8, num_hidden_layers=80),
}


def published_model(name: str, cache: dict | None = None):
    """The ModelSource (`autopar.planning.estimate`) of a published architecture; `cache` keeps one per
    name, so its captures are made once."""
    from transformers import AutoConfig

    from autopar.planning.estimate import load_model_source

    cache = {} if cache is None else cache
    if name not in cache:
        cfg = dict(MODELS[name])
        cache[name] = load_model_source(AutoConfig.for_model(cfg.pop("model_type"), **cfg))
        cache[name].name = name
    return cache[name]
