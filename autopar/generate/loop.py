"""Generation: `pmodel.generate(...)` for causal LMs, with a static KV cache split over the grid.

Two programs run a generation, each compiled like any other call (capture, propagate, insert
collectives, localize) from the model wrapped with a static cache (`CachedLM`):

    prefill  the prompt's tokens [B, P] -> the last position's logits; writes cache slots 0..P-1
    decode   one token per sequence [B, 1] -> its logits; writes the slot after the last one written

The cache is two buffers per layer, keys and values [B, kv_heads, L, head_dim], marked `PLACED`
before propagation: batch over the grid rows, KV heads over the columns (`S(0)S(1)`; an axis that
does not divide its dim keeps it whole over that axis). Columns that divide the query heads but not
the KV heads (1x4 with 2 KV heads) split a cache of each KV head repeated (`kv_repeat`), so each
column keeps only the KV heads its query heads read, as grouped-query attention picks them in
training. Each rank allocates only its block and the programs write the new tokens' keys and values
into it in place (`index_copy_`), so the cache is whole on a rank only where neither axis divides,
and a decode step computes only the new token: the prefix is read from the cache.

Programs are keyed by (phase, batch B, cache length L, for prefill the prompt length P, and the
phase's strategy). L is the cache length bucket: `max_cache_len` when given, else prompt +
max_new_tokens rounded up to a multiple of `BUCKET`; one decode program serves every step of every
generation with the same (B, L). Each phase has a plan (`autopar.generate.phases`): by default a
model parallelized with strategy='auto' searches one per phase, priced as a forward alone, and a
'2d' or '1d' model runs the forward's plan on its parameter blocks as stored. The parameters a
phase's own plan lays out otherwise are copies kept across calls and refreshed when the parameters
change, so a model generates right after training steps. With `compile=True` each program runs
under torch.compile, compiled on its first call and reused (`ParallelModule._run`).

Token choice follows transformers' `GenerationMixin` (its logits processors, stopping criteria and
special-token handling, on full last-position logits gathered on every rank): greedy output is the
unmodified model's, and sampling matches when every rank seeds its generator alike.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import math
import re

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from passes.layout import Layout, local_shape
from passes.meta import PARAM, PLACED
from passes.ops import comm
from autopar.generate.phases import (PhasePlan, Relaid, estimate_phase, phase_options, phase_plan, phase_strategy,
                                     stored_bytes)
from autopar.program.guards import fingerprint
from autopar.program.build import Compiled, capture, compile_captured
from autopar.errors import MemoryLimitError, SignatureError, UnsupportedError, UsageError

__all__ = ["BUCKET", "CachedLM", "Generator", "cache_layout", "kv_cache_bytes_per_rank", "kv_repeat",
           "capture_cached"]

BUCKET = 64  # cache lengths are rounded up to a multiple of this unless max_cache_len is given
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


def _refuse(model) -> None:
    """Models generate cannot serve, refused before anything is compiled."""
    config = getattr(model, "config", None)
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedError(
            f"pmodel.generate: {type(model).__name__} is an encoder-decoder model; autopar generates with "
            f"decoder-only causal LMs. What is missing for it: an encoder program run once per prompt and "
            f"a cross-attention cache of the encoder's keys and values beside the self-attention cache. "
            f"Generate with the original model (load the trained weights into it with pmodel.state_dict())"
        )
    can = getattr(model, "can_generate", None)
    if not (callable(can) and can()):
        raise UsageError(
            f"pmodel.generate needs a causal language model (a transformers model with a language-modeling "
            f"head, e.g. LlamaForCausalLM); {type(model).__name__} cannot generate. Parallelize its "
            f"*ForCausalLM class instead"
        )


def _refuse_beams(gc) -> None:
    if (gc.num_beams or 1) != 1:
        raise UnsupportedError(
            f"pmodel.generate: num_beams={gc.num_beams}: beam search is not supported; use greedy search "
            f"(the default) or sampling (do_sample=True)"
        )


def _cache_buffer(name) -> str:
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
        elif role == "buffer" and _cache_buffer(key) in ("k", "v"):
            node.meta[PLACED] = layout
    for node in cap.gm.graph.nodes:  # module paths as in the language model (strategy units, explain)
        stack = node.meta.get("nn_module_stack")
        if stack:
            node.meta["nn_module_stack"] = {k: (plain(path), cls) for k, (path, cls) in stack.items()}
    cap.sources = [(role, plain(key)) if role in ("param", "buffer") else (role, key) for role, key in cap.sources]
    cap.buffers = {plain(k): v for k, v in cap.buffers.items()}
    cap.persistent = set()
    return cap


class Generator:
    """The generation programs and KV cache of one ParallelModule (see the module docstring for how
    programs are keyed); `pmodel.generate` builds it on first use."""

    def __init__(self, pmodel):
        self.pmodel = pmodel
        self.programs: dict = {}  # (phase, B, L[, P], strategy) -> Compiled
        self.layouts: dict = {}  # the same keys -> the parameter layouts that program reads
        self.plans: dict[tuple, PhasePlan] = {}  # the same keys -> how that program was planned
        self.cache: dict = {}  # buffer name -> this rank's block, for `cache_key`
        self.cache_key: tuple | None = None  # (B, L) the cache is allocated for
        self._layout: Layout | None = None
        self.relaid = Relaid()  # parameter blocks laid out for a phase's own plan, kept across calls

    def program(self, phase: str, inputs: tuple, max_len: int, strategy: str | None = None) -> Compiled:
        """The program of `phase` for these inputs (input_ids, mask, positions, start), compiled once.
        `strategy` None: the forward's plan on the parameters as stored; '2d', '1d' or 'auto': that
        strategy for this phase alone (parameters it lays out otherwise are read from `relaid`)."""
        batch, length = inputs[0].shape
        key = (phase, batch, max_len) + ((length,) if phase == "prefill" else ()) + (strategy,)
        if key not in self.programs:
            self.programs[key], self.layouts[key], self.plans[key] = self._compile(key, inputs, max_len, strategy)
        return self.programs[key]

    def _compile(self, key: tuple, inputs: tuple, max_len: int, strategy: str | None) -> tuple:
        pm = self.pmodel
        model = pm.source_model
        meta = any(p.is_meta for p in model.parameters())
        device = torch.device("meta") if meta else inputs[0].device
        cap = capture_cached(model, inputs[0].shape[0], max_len, device, pm.grid.shape, inputs,
                             pm._options.indivisible == "uneven")
        estimate = estimate_phase(pm, cap.gm, strategy)
        if strategy is None:
            first = next(iter(pm._compiled.values()))
            comp, layouts = compile_captured(cap, ("generate",) + key, pm.grid, pm._options, first.choice,
                                             pinned=pm._param_layouts)
        else:
            options = phase_options(pm._options, strategy, stored_bytes(pm))
            try:
                comp, layouts = compile_captured(cap, ("generate",) + key, pm.grid, options)
            except MemoryError as e:  # raised on every rank (the search's verdict is rank 0's)
                raise MemoryLimitError(f"pmodel.generate, {key[0]}: {e} The phase's own plan must fit memory_limit "
                                       f"less the parameter blocks this rank stores; pass {key[0]}_strategy='forward' "
                                       f"to run the forward's plan.") from e
        pm._check_parameters(comp, inputs, {})
        return comp, layouts, phase_plan(pm, strategy, comp, estimate)

    def allocate(self, comp: Compiled, batch: int, max_len: int) -> None:
        """This rank's cache blocks for (batch, max_len), zeroed; kept for the next generation of that size."""
        if self.cache_key != (batch, max_len):
            self.cache = {}
            for node, (role, key) in zip(comp.gm.graph.find_nodes(op="placeholder"), comp.captured.sources):
                if role == "buffer" and _cache_buffer(key):
                    v = node.meta["val"]
                    self._layout = node.meta.get(PLACED, self._layout)
                    grid = self.pmodel.grid
                    shape = local_shape(tuple(v.shape), node.meta.get(PLACED, Layout((Replicate(), Replicate()))),
                                        grid.shape, at=(grid.r, grid.c))
                    self.cache[key] = torch.zeros(shape, dtype=v.dtype, device=comp.captured.device)
            self.cache_key = (batch, max_len)
        for t in self.cache.values():
            t.zero_()

    def kv_cache_bytes(self) -> int:
        """Bytes of the key and value blocks this rank holds (0 before the first generate)."""
        return sum(t.numel() * t.element_size() for name, t in self.cache.items() if _cache_buffer(name) in ("k", "v"))

    @property
    def cache_layout(self) -> Layout | None:
        """The layout of the keys and values [B, kv_heads, L, head_dim] allocated now."""
        return self._layout

    def _param(self, name: str, layout: Layout | None) -> torch.Tensor:
        """This rank's block of parameter `name` in `layout`: the stored block, or (a phase planned
        with its own strategy) the copy laid out so (`generate_phases.Relaid`)."""
        p = self.pmodel.get_parameter(name)
        if layout is None or tuple(layout.placements) == tuple(p.placements):
            return p.to_local()
        return self.relaid.get(name, p, layout)

    def run(self, comp: Compiled, inputs: tuple) -> torch.Tensor:
        """One program on this rank's parameter and cache blocks; the logits [B, 1, V], whole."""
        pm = self.pmodel
        layouts = self.layouts.get(comp.signature[1:], {})
        locals_ = []
        for role, key in comp.captured.sources:
            if role == "param":
                locals_.append(self._param(key, layouts.get(key)))
            elif role == "buffer":
                locals_.append(self.cache[key] if key in self.cache else _buffer(pm, key))
            elif role == "constant":
                locals_.append(comp.captured.constants[key])
            else:
                locals_.append(inputs[key])
        out = pm._run(comp, locals_)  # with compile=True: compiled once per program (its key)
        out = out[0] if isinstance(out, (tuple, list)) else out
        lay, shape = comp.out_layouts[0]
        if lay.is_replicated:
            return out
        stride = torch.empty(shape, device="meta").stride()
        return DTensor.from_local(out, pm.grid.mesh, list(lay.placements), run_check=False,
                                  shape=torch.Size(shape), stride=stride).full_tensor()


def _buffer(pm, name: str) -> torch.Tensor:
    """A model buffer: the ParallelModule's copy, or the source model's when no forward used it."""
    try:
        return pm.get_buffer(name)
    except AttributeError:
        return pm.source_model.get_buffer(name)


def generate(pmodel, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
             max_cache_len: int | None = None, prefill_strategy: str | None = None,
             decode_strategy: str | None = None, generation_config=None, **kwargs):
    """`pmodel.generate`: see `autopar.parallel.module.ParallelModule.generate`."""
    from transformers.generation import GenerateDecoderOnlyOutput, StoppingCriteriaList

    model = pmodel.source_model
    _refuse(model)
    batch, prompt = input_ids.shape
    gc, max_len = _config(model, generation_config, kwargs, prompt, max_cache_len)
    prefill_strategy = phase_strategy(pmodel, "prefill_strategy", prefill_strategy)
    decode_strategy = phase_strategy(pmodel, "decode_strategy", decode_strategy)
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    _agree(pmodel.grid, (batch, prompt, max_len, bool(gc.do_sample), fingerprint(input_ids)[-12:],
                         fingerprint(attention_mask)[-12:]))
    device = input_ids.device
    model._prepare_special_tokens(gc, True, device=device)
    processors = model._get_logits_processor(generation_config=gc, input_ids_seq_length=prompt,
                                             encoder_input_ids=input_ids, device=device,
                                             model_kwargs={"attention_mask": attention_mask})
    stopping = model._get_stopping_criteria(gc, StoppingCriteriaList())
    eos_stops = any(hasattr(c, "eos_token_id") for c in stopping)
    gen = pmodel._generator
    mask = torch.zeros(batch, max_len, dtype=attention_mask.dtype, device=device)  # [B, L] over cache slots
    mask[:, :prompt] = attention_mask
    positions = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)  # as HF does
    inputs = (input_ids, mask, positions, torch.tensor(0, device=device))
    scores, logits_seen = [], []
    sequences, unfinished = input_ids, torch.ones(batch, dtype=torch.long, device=device)
    with torch.no_grad():
        comp = gen.program("prefill", inputs, max_len, prefill_strategy)
        gen.allocate(comp, batch, max_len)
        logits = gen.run(comp, inputs)
        while True:
            tokens, chosen, raw = _next_tokens(gc, processors, sequences, logits, unfinished if eos_stops else None)
            scores.append(chosen)
            logits_seen.append(raw)
            sequences = torch.cat([sequences, tokens[:, None]], dim=-1)
            unfinished = unfinished & ~stopping(sequences, tuple(scores))
            if unfinished.max() == 0:
                break
            slot = sequences.shape[1] - 1  # the new token's cache slot
            mask[:, slot] = 1
            positions = positions[:, -1:] + 1
            inputs = (tokens[:, None], mask, positions, torch.tensor(slot, device=device))
            logits = gen.run(gen.program("decode", inputs, max_len, decode_strategy), inputs)
    if not gc.return_dict_in_generate:
        return sequences
    return GenerateDecoderOnlyOutput(sequences=sequences,
                                     scores=tuple(scores) if gc.output_scores else None,
                                     logits=tuple(logits_seen) if gc.output_logits else None)


def _next_tokens(gc, processors, sequences, logits, unfinished) -> tuple:
    """(the next token of each row, its processed scores, the raw last-position logits), as
    transformers' sampling loop picks them; rows already finished (`unfinished` 0) get the pad token."""
    raw = logits[:, -1].to(dtype=torch.float32, copy=True)  # [B, V]
    chosen = processors(sequences, raw)
    if gc.do_sample:
        tokens = torch.multinomial(torch.softmax(chosen, dim=-1), num_samples=1).squeeze(1)
    else:
        tokens = torch.argmax(chosen, dim=-1)
    if unfinished is not None:
        tokens = tokens * unfinished + gc._pad_token_tensor * (1 - unfinished)
    return tokens, chosen, raw


def _config(model, generation_config, kwargs: dict, prompt: int, max_cache_len: int | None) -> tuple:
    """(the GenerationConfig of this call: the model's, or the one given, updated by `kwargs`; the
    cache length), refusing unknown keywords, beam search and a request beyond `max_cache_len`."""
    gc = copy.deepcopy(generation_config if generation_config is not None else model.generation_config)
    unknown = gc.update(**kwargs)
    if unknown:
        raise SignatureError(f"pmodel.generate got keywords it does not take: {sorted(unknown)}; it takes "
                             f"input_ids, attention_mask, max_cache_len, prefill_strategy, decode_strategy and "
                             f"GenerationConfig fields")
    _refuse_beams(gc)
    if gc.max_new_tokens is not None:
        gc.max_length = prompt + gc.max_new_tokens
    new = gc.max_length - prompt
    if new < 1:
        raise UsageError(f"pmodel.generate: max_length={gc.max_length} leaves no new token after a prompt of "
                         f"{prompt}; pass max_new_tokens >= 1")
    max_len = max_cache_len or -(-gc.max_length // BUCKET) * BUCKET
    if gc.max_length > max_len:
        raise UsageError(
            f"pmodel.generate: a prompt of {prompt} tokens plus max_new_tokens={new} needs {gc.max_length} "
            f"cache slots, but max_cache_len={max_len}; pass a larger max_cache_len (or none: the cache is "
            f"then sized to the request) or fewer new tokens")
    return gc, max_len


def _agree(grid, mine: tuple) -> None:
    """Every rank of a grid asks for the same generation (batch, prompt length, cache length, sampling,
    and a hash of input_ids and attention_mask): the programs run collectives and would hang or mix
    blocks otherwise."""
    everyone = [None] * grid.world
    with comm.guarded(grid, "generate all-gather", "grid", "generate"):
        dist.all_gather_object(everyone, mine, group=grid.world_group)
    base = grid.dp_index * grid.world
    differ = [base + r for r, theirs in enumerate(everyone) if theirs != everyone[0]]
    if differ:
        names = "(batch size, prompt length, cache length, do_sample, input_ids hash, attention_mask hash)"
        raise UsageError(
            f"pmodel.generate: ranks of one grid asked for different generations {names}: rank {base} "
            f"{everyone[0]}, ranks {differ} {[everyone[r - base] for r in differ]}; every rank of a grid "
            f"must pass the same input_ids and the same generation arguments"
        )
