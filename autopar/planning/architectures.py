"""Published model architectures by name (the model cards' figures), for `autopar estimate`, `autopar
plan` and the published record (`autopar.bench.published`): built from their transformers configs on
the meta device, no weights."""

from __future__ import annotations

__all__ = ["MEGATRON_GPT", "MODELS", "published_model"]

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

# Megatron-LM's GPT models of its H100 weak-scaling table (README of NVIDIA/Megatron-LM, "Training Speed and
# Scalability", images/model_table.png, July 2024): GPT-3's blocks (pre-LayerNorm, full multi-head attention,
# a GeLU MLP of 4h), vocabulary 131,072, sequences of 4,096. Among transformers' families GPT-NeoX with
# sequential residuals has those products and runs attention through SDPA (its rotary positions for GPT's
# learned ones cost no products). OPT, the closest in its positions, flattens tokens before its MLP, and
# autopar's 1D plan of it moves 1.25x Megatron-SP's bytes with two or more sequences per micro-batch
# (docs/guide/limitations.md).
_MEGATRON_GPT = dict(model_type="gpt_neox", vocab_size=131072, max_position_embeddings=4096,
                     use_parallel_residual=False, tie_word_embeddings=True)
MEGATRON_GPT = {  # name -> (attention heads, hidden size, layers), the table's columns
    "megatron-gpt-1.7b": (16, 2048, 24), "megatron-gpt-7.1b": (32, 4096, 30), "megatron-gpt-16b": (48, 6144, 32),
    "megatron-gpt-32b": (56, 7168, 48), "megatron-gpt-70b": (64, 8192, 84), "megatron-gpt-119b": (80, 10240, 92),
    "megatron-gpt-177b": (96, 12288, 96), "megatron-gpt-314b": (128, 16384, 96),
    "megatron-gpt-462b": (144, 18432, 112),
}
MODELS.update({name: dict(_MEGATRON_GPT, num_attention_heads=n, hidden_size=h, intermediate_size=4 * h,
                          num_hidden_layers=layers) for name, (n, h, layers) in MEGATRON_GPT.items()})


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
