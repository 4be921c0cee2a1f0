"""Generation: `pmodel.generate(...)` for causal LMs, with a static KV cache split over the grid
(`autopar.generate.cache`).

Two programs run a generation, each compiled like any other call (capture, propagate, insert
collectives, localize) from the model wrapped with a static cache (`CachedLM`):

    prefill  the prompt's tokens [B, P] -> the last position's logits; writes cache slots 0..P-1
    decode   one token per sequence [B, 1] -> its logits; writes the slot after the last one written

Each rank allocates only its block of the cache and the programs write the new tokens' keys and
values into it in place (`index_copy_`), so the cache is whole on a rank only where neither axis
divides, and a decode step computes only the new token: the prefix is read from the cache.

Programs are keyed by (phase, batch B, cache length L, for prefill the prompt length P, and the
phase's strategy). L is the cache length bucket: `max_cache_len` when given, else prompt +
max_new_tokens rounded up to a multiple of `BUCKET`; one decode program serves every step of every
generation with the same (B, L). Each phase has a plan (`autopar.generate.phases`): by default a
model parallelized with strategy='auto' searches one per phase, priced as a forward alone, and a
'2d' or '1d' model runs the forward's plan on its parameter blocks as stored. The parameters a
phase's own plan lays out otherwise are copies kept across calls and refreshed when the parameters
change, so a model generates right after training steps. With `compile=True` each program runs
under torch.compile, compiled on its first call and reused (`ParallelModule.run_program`).

Token choice follows transformers' `GenerationMixin` (its logits processors, stopping criteria and
special-token handling, on full last-position logits gathered on every rank): greedy output is the
unmodified model's, and sampling matches when every rank seeds its generator alike.
"""

from __future__ import annotations

import copy
import dataclasses

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from passes.layout import Layout, local_shape
from passes.meta import PLACED
from passes.ops import comm
from autopar.generate.cache import cache_buffer, capture_cached
from autopar.generate.phases import (PhasePlan, Relaid, estimate_phase, phase_options, phase_plan, phase_strategy,
                                     stored_bytes)
from autopar.program.consensus import all_gather_objects
from autopar.program.guards import fingerprint
from autopar.program.build import Compiled, compile_captured
from autopar.errors import MemoryLimitError, SignatureError, UnsupportedError, UsageError

__all__ = ["BUCKET", "Generator", "generate"]

BUCKET = 64  # cache lengths are rounded up to a multiple of this unless max_cache_len is given


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
                             pm.options.indivisible == "uneven")
        estimate = estimate_phase(pm, cap.gm, strategy)
        if strategy is None:  # with context_parallel each cp copy of the grid generates the whole sequence
            comp, layouts = compile_captured(cap, ("generate",) + key, pm.grid,
                                             dataclasses.replace(pm.options, context_parallel=1), pm.choice,
                                             pinned=pm.param_layouts)
        else:
            options = phase_options(pm.options, strategy, stored_bytes(pm))
            try:
                comp, layouts = compile_captured(cap, ("generate",) + key, pm.grid, options)
            except MemoryError as e:  # raised on every rank (the search's verdict is rank 0's)
                raise MemoryLimitError(f"pmodel.generate, {key[0]}: {e} The phase's own plan must fit memory_limit "
                                       f"less the parameter blocks this rank stores; pass {key[0]}_strategy='forward' "
                                       f"to run the forward's plan.") from e
        pm.check_parameters(comp, inputs, {})
        return comp, layouts, phase_plan(pm, strategy, comp, estimate)

    def allocate(self, comp: Compiled, batch: int, max_len: int) -> None:
        """This rank's cache blocks for (batch, max_len), zeroed; kept for the next generation of that size."""
        if self.cache_key != (batch, max_len):
            self.cache = {}
            for node, (role, key) in zip(comp.gm.graph.find_nodes(op="placeholder"), comp.captured.sources):
                if role == "buffer" and cache_buffer(key):
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
        return sum(t.numel() * t.element_size() for name, t in self.cache.items() if cache_buffer(name) in ("k", "v"))

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
        out = pm.run_program(comp, locals_)  # with compile=True: compiled once per program (its key)
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
    _agree(pmodel.grid, (batch, prompt, max_len, fingerprint(input_ids)[-12:], fingerprint(attention_mask)[-12:],
                         prefill_strategy, decode_strategy, _settings(gc)))
    device = input_ids.device
    model._prepare_special_tokens(gc, True, device=device)
    processors = model._get_logits_processor(generation_config=gc, input_ids_seq_length=prompt,
                                             encoder_input_ids=input_ids, device=device,
                                             model_kwargs={"attention_mask": attention_mask})
    stopping = model._get_stopping_criteria(gc, StoppingCriteriaList())
    eos_stops = any(hasattr(c, "eos_token_id") for c in stopping)
    gen = pmodel.generator
    gen.relaid.begin(pmodel)  # copies of weights changed since the last call are made again
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
            tokens, chosen, raw = _next_tokens(gc, processors, sequences, logits, unfinished if eos_stops else None,
                                               pmodel.grid)
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


def _next_tokens(gc, processors, sequences, logits, unfinished, grid) -> tuple:
    """(the next token of each row, its processed scores, the raw last-position logits), as
    transformers' sampling loop picks them; rows already finished (`unfinished` 0) get the pad token.
    A sampled token is the draw of the grid's first rank, sent to the others: ranks whose random
    generators differ (a per-rank seed) still agree, and each rank's tokens equal what one process
    seeded as that first rank draws."""
    raw = logits[:, -1].to(dtype=torch.float32, copy=True)  # [B, V]
    chosen = processors(sequences, raw)
    if gc.do_sample:
        tokens = torch.multinomial(torch.softmax(chosen, dim=-1), num_samples=1).squeeze(1)
        if grid.world > 1:
            with comm.guarded(grid, "generate sampled-token broadcast", "grid", "generate"):
                dist.broadcast(tokens, src=grid.base, group=grid.world_group)
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


def _settings(gc) -> dict:
    """The generation arguments of this call (every GenerationConfig field that differs from the
    defaults: max_length, do_sample, temperature, top_k, eos_token_id, ...), as plain text values."""
    return {k: repr(v) for k, v in sorted(gc.to_diff_dict().items())}


_AGREED = ("batch size", "prompt length", "cache length", "input_ids hash", "attention_mask hash",
           "prefill_strategy", "decode_strategy")


def _agree(grid, mine: tuple) -> None:
    """Every rank of a grid asks for the same generation (batch, prompt length, cache length, a hash of
    input_ids and attention_mask, the phase strategies, every generation argument): the programs run
    collectives, and a rank asking for fewer tokens would return while the others wait. Raises on
    every rank, naming what differs."""
    everyone = all_gather_objects(mine, grid.world_group, comm.guarded(grid, "generate all-gather", "grid", "generate"))
    base = grid.base
    differ = [base + r for r, theirs in enumerate(everyone) if theirs != everyone[0]]
    if differ:
        first = everyone[differ[0] - base]
        names = [n for n, a, b in zip(_AGREED, everyone[0], first) if a != b]
        ours, theirs = everyone[0][-1], first[-1]
        names += [f"{k} ({ours.get(k, 'default')} vs {theirs.get(k, 'default')})"
                  for k in sorted(set(ours) | set(theirs)) if ours.get(k) != theirs.get(k)]
        raise UsageError(
            f"pmodel.generate: ranks of one grid asked for different generations: rank {base} and ranks {differ} "
            f"differ in {', '.join(names)}; every rank of a grid must pass the same input_ids and the same "
            f"generation arguments"
        )
