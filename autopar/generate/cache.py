"""The static KV cache of generation, split over the grid, and the model wrapper that holds it.

The cache is two buffers per layer, keys and values [B, kv_heads, L, head_dim], marked `PLACED`
before propagation: batch over the grid rows, KV heads over the columns (`S(0)S(1)`; an axis that
does not divide its dim keeps it whole over that axis). Columns that divide the query heads but not
the KV heads (1x4 with 2 KV heads) split a cache of each KV head repeated (`kv_repeat`), so each
column keeps only the KV heads its query heads read, as grouped-query attention picks them in
training. `CachedLM` wraps a causal LM with such a cache for capture; `capture_cached` captures it
named as the language model, with its cache placed (the programs are compiled and run by
`autopar.generate.loop`).
"""

from __future__ import annotations

import contextlib
import inspect
import math
import re

import torch
import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard

from passes.layout import Layout, local_shape
from passes.meta import PARAM, PLACED
from autopar.program.build import capture

__all__ = ["CachedLM", "cache_buffer", "cache_layout", "capture_cached", "kv_cache_bytes_per_rank", "kv_repeat"]

_PREFIX = "model."  # CachedLM holds the language model under this name


def _heads(config) -> tuple:
    """(query heads, KV heads, head dim) of a decoder config: GQA configs name num_key_value_heads;
    GPT-2 n_head."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(config, "num_attention_heads", None) or config.n_head
    kv = getattr(config, "num_key_value_heads", None) or heads
    hidden = getattr(config, "hidden_size", None) or config.n_embd
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    return heads, kv, head_dim


def _head_shapes(config) -> tuple:
    """(KV heads, head dim) of a decoder config."""
    return _heads(config)[1:]


def kv_repeat(config, grid_shape: tuple) -> int:
    """How many times the cache holds each KV head: 1, unless the C columns divide the query heads hq
    but not the KV heads kv; then r = lcm(kv, C) / kv (when lcm(kv, C) divides hq), and the cache holds
    lcm(kv, C) heads, KV head i as heads [i r, (i+1) r), split over the columns like the query heads:
    column c's query heads read exactly the KV heads of its block (a local group of hq / lcm(kv, C)).

    >>> from transformers import LlamaConfig
    >>> cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    >>> kv_repeat(cfg, (1, 4)), kv_repeat(cfg, (2, 2)), kv_repeat(cfg, (1, 3))
    (2, 1, 1)
    """
    heads, kv, _ = _heads(config)
    cols = grid_shape[1]
    if cols == 1 or kv % cols == 0 or heads % cols:
        return 1
    held = math.lcm(kv, cols)
    return held // kv if heads % held == 0 else 1


def cache_layout(batch: int, kv_heads: int, grid_shape: tuple, uneven: bool = False,
                 heads: int | None = None) -> Layout:
    """Keys/values [B, kv_heads, L, head_dim]: batch over rows and KV heads over columns, each axis
    where it divides its dim. With `uneven` (`indivisible="uneven"`, the default) a batch the rows do not
    divide is cut in torch.chunk blocks as the activations are, and so are the KV heads when they are the
    query heads (`heads`: every column's query heads read their own KV heads); otherwise that dim stays
    whole over the axis.

    >>> cache_layout(8, 4, (2, 2)), cache_layout(1, 4, (2, 2)), cache_layout(8, 2, (2, 4))
    (S(0)S(1), RS(1), S(0)R)
    >>> cache_layout(3, 3, (2, 2), uneven=True, heads=3), cache_layout(3, 2, (2, 4), uneven=True, heads=4)
    (S(0)S(1), S(0)R)
    """
    rows, cols = grid_shape
    return Layout((Shard(0) if rows > 1 and (batch % rows == 0 or uneven) else Replicate(),
                   Shard(1) if cols > 1 and (kv_heads % cols == 0 or (uneven and kv_heads == heads)) else Replicate()))


def kv_cache_bytes_per_rank(config, batch: int, max_len: int, grid_shape: tuple, dtype=torch.float32,
                            uneven: bool = True) -> int:
    """Bytes of KV cache the rank holding the most holds: 2 (keys, values) * layers * its block of
    [B, kv_heads, L, head_dim] (B/R * kv_heads/C * L * head_dim when both divide; torch.chunk blocks,
    the largest at grid position (0, 0), where they do not and `uneven`) * element size.

    >>> from transformers import LlamaConfig
    >>> cfg = LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    >>> kv_cache_bytes_per_rank(cfg, 8, 128, (2, 2))  # 2 * 2 * (8/2 * 2/2 * 128 * 16) * 4
    131072
    >>> kv_cache_bytes_per_rank(cfg, 8, 128, (1, 4))  # 2 KV heads on 4 columns: each keeps the one it reads
    262144
    >>> kv_cache_bytes_per_rank(cfg, 3, 128, (2, 2))  # batch 3 on 2 rows: 2 * 2 * (2 * 1 * 128 * 16) * 4
    65536
    """
    heads, kv, head_dim = _heads(config)
    kv *= kv_repeat(config, grid_shape)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers = getattr(text, "num_hidden_layers", None) or text.n_layer
    layout = cache_layout(batch, kv, grid_shape, uneven, heads)
    block = local_shape((batch, kv, max_len, head_dim), layout, grid_shape, at=(0, 0))
    return 2 * layers * math.prod(block) * torch.empty((), dtype=dtype).element_size()


class CachedLM(nn.Module):
    """A causal LM and a static KV cache held as buffers (`k{i}`, `v{i}`, and `n{i}`, the slots written
    so far): forward(input_ids [B, s], attention_mask [B, L], position_ids [B, s], start []) writes the
    s new tokens' keys and values at slots start..start+s-1 and returns the last position's logits
    [B, 1, V]. With `repeat` r > 1 the cache holds each KV head r times ([B, kv r, L, head_dim]; run
    the model under `_kv_groups`). Built for capture only: the buffers it traces with stand for each
    rank's blocks."""

    def __init__(self, model: nn.Module, batch: int, max_len: int, device: torch.device, repeat: int = 1):
        super().__init__()
        from transformers import StaticCache
        from transformers.cache_utils import StaticLayer, StaticSlidingWindowLayer

        self.model = model
        self.cache = StaticCache(config=model.config, max_cache_len=max_len)
        for i, layer in enumerate(self.cache.layers):
            if repeat > 1:  # every layer repeats its KV heads (a full layer, also for a window: below)
                self.cache.layers[i] = _repeated_layer(max_len, repeat)
            elif isinstance(layer, StaticSlidingWindowLayer):  # a window's rolling writes cannot be traced:
                self.cache.layers[i] = StaticLayer(max_len)  # a full layer, with the model's windowed mask
        kv, head_dim = _head_shapes(model.config)
        dtype = next(model.parameters()).dtype
        self.cache.early_initialization(batch, kv * repeat, head_dim, dtype, device)
        for i, layer in enumerate(self.cache.layers):
            self.register_buffer(f"k{i}", layer.keys, persistent=False)
            self.register_buffer(f"v{i}", layer.values, persistent=False)
            self.register_buffer(f"n{i}", layer.cumulative_length, persistent=False)
        params = inspect.signature(model.forward).parameters
        self._keep_one = "logits_to_keep" in params
        self._cache_arg = "cache" if "cache" in params else "past_key_values"  # renamed in transformers 5

    def forward(self, input_ids, attention_mask, position_ids, start):
        for i, layer in enumerate(self.cache.layers):  # read the buffers as traced (export swaps them)
            layer.keys, layer.values = getattr(self, f"k{i}"), getattr(self, f"v{i}")
            layer.cumulative_length = getattr(self, f"n{i}")
            layer.cumulative_length.copy_(start)
        extra = {"logits_to_keep": 1} if self._keep_one else {}
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         use_cache=True, **{self._cache_arg: self.cache}, **extra)
        return out.logits[:, -1:]  # [B, 1, V]


def _repeated_layer(max_len: int, repeat: int):
    """A static cache layer holding each KV head `repeat` times: new keys and values [B, kv, s, d] are
    written as [B, kv repeat, s, d] (KV head i at heads [i repeat, (i+1) repeat))."""
    from transformers.cache_utils import StaticLayer
    from transformers.integrations.sdpa_attention import repeat_kv

    class RepeatedLayer(StaticLayer):
        def update(self, key_states, value_states, *args, **kwargs):
            return super().update(repeat_kv(key_states, repeat), repeat_kv(value_states, repeat), *args, **kwargs)

    return RepeatedLayer(max_len)


@contextlib.contextmanager
def _kv_groups(model: nn.Module, groups: int | None):
    """Attention modules read `groups` query heads per cached KV head (their `num_key_value_groups`,
    which transformers' attention functions repeat or group KV heads by) inside; None: as they are."""
    mods = [m for m in model.modules() if groups is not None and hasattr(m, "num_key_value_groups")]
    saved = [m.num_key_value_groups for m in mods]
    for m in mods:
        m.num_key_value_groups = groups
    try:
        yield
    finally:
        for m, g in zip(mods, saved):
            m.num_key_value_groups = g


def capture_cached(model: nn.Module, batch: int, max_len: int, device, grid_shape: tuple, inputs: tuple,
                   uneven: bool = True):
    """The captured CachedLM of `model` for `inputs` (input_ids, mask, positions, start), in eval mode,
    named as the model and with its cache placed for `grid_shape` (KV heads repeated per `kv_repeat`)."""
    heads, kv, _ = _heads(model.config)
    r = kv_repeat(model.config, grid_shape)
    was = model.training
    model.eval()
    try:
        with _kv_groups(model, heads // (kv * r) if r > 1 else None):
            cap = capture(CachedLM(model, batch, max_len, device, r), inputs, {})
    finally:
        model.train(was)
    return _marked(cap, cache_layout(batch, kv * r, grid_shape, uneven, heads))


def cache_buffer(name) -> str:
    """'k', 'v' or 'n' for CachedLM's cache buffers (k0, v0, n0, ...), '' for any other name."""
    return name[0] if re.fullmatch(r"[kvn]\d+", str(name)) else ""


def _marked(cap, layout: Layout):
    """The captured CachedLM with its parameters, buffers and module paths named as in the language
    model (the `model.` prefix dropped) and its key/value buffers placed in `layout`."""
    def plain(name):
        return name[len(_PREFIX):] if isinstance(name, str) and name.startswith(_PREFIX) else name

    for node, (role, key) in zip(cap.gm.graph.find_nodes(op="placeholder"), list(cap.sources)):
        if role == "param":
            node.meta[PARAM] = plain(node.meta[PARAM])
        elif role == "buffer" and cache_buffer(key) in ("k", "v"):
            node.meta[PLACED] = layout
    for node in cap.gm.graph.nodes:  # module paths as in the language model (strategy units, explain)
        stack = node.meta.get("nn_module_stack")
        if stack:
            node.meta["nn_module_stack"] = {k: (plain(path), cls) for k, (path, cls) in stack.items()}
    cap.sources = [(role, plain(key)) if role in ("param", "buffer") else (role, key) for role, key in cap.sources]
    cap.buffers = {plain(k): v for k, v in cap.buffers.items()}
    cap.persistent = set()
    return cap
