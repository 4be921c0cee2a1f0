"""Checkpoint key names as transformers reads and writes them, decided by transformers itself.

A transformers 5 checkpoint does not always name a tensor the way the model does: GPT-NeoX's head is
`embed_out` in the file and `lm_head` in the model, ViT's `attention.attention.query` is the model's
`attention.q_proj`, a Mixtral file holds one tensor per expert where the model holds them stacked,
an old BERT file says `LayerNorm.gamma`. A tied pair is stored once, and a base model's file loads
into the model with a head (and the reverse). transformers keeps these rules per architecture in
`conversion_mapping`; this module asks it for them rather than keeping a table of its own:

- `load_plan(model, shapes)`: for each tensor of `model`'s state dict, the checkpoint key it is read
  from, or the `Conversion` (a transformers `WeightConverter` and its source keys) that computes it;
  plus the keys nothing reads and the names nothing fills, filtered as transformers filters them.
- `save_names(model)` / `save_groups(model, names)` / `revert(model, tensors)`: the state-dict names
  transformers' `save_pretrained` writes (one per tied group), grouped so that each group can be
  converted back on its own, and that conversion (`revert_weight_conversion`).

Every transformers-internal name is imported in `transformers_internals()` below, the one place to
update when transformers moves them. A model that is not a transformers `PreTrainedModel` is saved
and loaded under its own parameter names.

    >>> import transformers
    >>> from autopar.checkpoint import meta_init
    >>> with meta_init():
    ...     model = transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
    ...         vocab_size=16, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16))
    >>> plan = load_plan(model, {k: tuple(v.shape) for k, v in model.state_dict().items() if k != "lm_head.weight"}
    ...                         | {"embed_out.weight": (16, 8)})
    >>> plan.sources["lm_head.weight"]
    'embed_out.weight'
"""

from __future__ import annotations

import copy
import functools
import types
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from autopar.errors import TransformersVersionError, UsageError

TESTED = "5.24"  # the transformers version these imports were checked against


@functools.lru_cache(maxsize=None)
def transformers_internals() -> types.SimpleNamespace:
    """transformers' own key-mapping machinery. `get_model_conversion_mapping` is public (PEFT uses it);
    the rest lives in `core_model_loading` / `modeling_utils` without a stability promise, as do the
    two model members used below (`_adjust_missing_and_unexpected_keys`, `_weight_conversions`), so a
    missing name is reported with the version it was tested with."""
    import transformers

    try:
        if not hasattr(transformers.PreTrainedModel, "_adjust_missing_and_unexpected_keys"):
            raise ImportError("PreTrainedModel._adjust_missing_and_unexpected_keys is gone")
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (PrefixChange, WeightConverter, WeightRenaming, apply_converters,
                                                     dot_natural_key, rename_source_key, revert_weight_conversion)
        from transformers.modeling_utils import remove_tied_weights_from_state_dict
    except ImportError as e:
        raise TransformersVersionError(
            f"autopar reads and writes checkpoint key names with transformers' own rules (transformers "
            f"{TESTED}), but transformers {transformers.__version__} lacks one of them ({e}); install "
            f"transformers>=5 (tested: {TESTED})"
        ) from None
    return types.SimpleNamespace(**{f.__name__: f for f in (
        get_model_conversion_mapping, PrefixChange, WeightConverter, WeightRenaming, apply_converters, dot_natural_key,
        rename_source_key, revert_weight_conversion, remove_tied_weights_from_state_dict)})


def is_transformers_model(model: nn.Module) -> bool:
    try:
        import transformers
    except ImportError:
        return False
    return isinstance(model, transformers.PreTrainedModel)


@dataclass
class Conversion:
    """A transformers `WeightConverter` (stacking experts, splitting a fused projection, ...) with the
    checkpoint keys it reads, in transformers' order."""
    converter: object
    first: str  # the name transformers keys the conversion by (its first target)
    keys: list = field(default_factory=list)  # [(checkpoint key, source pattern)]

    def run(self, model: nn.Module, read) -> dict:
        """{model name: full tensor}, with `read(key)` giving the whole checkpoint tensor `key`."""
        conv = copy.deepcopy(self.converter)  # converting consumes the collected tensors
        for key, pattern in self.keys:
            conv.add_tensor(self.first, key, pattern, functools.partial(read, key))
        out = conv.convert(self.first, model=model, config=model.config)
        return {n: t[0] if isinstance(t, list) else t for n, t in out.items()}

    def ops(self) -> str:
        return ", ".join(type(op).__name__ for op in self.converter.operations)


@dataclass
class LoadPlan:
    sources: dict  # model state-dict name -> checkpoint key, or the Conversion that computes it
    unexpected: list  # checkpoint keys that fill nothing (transformers' ignore patterns removed)
    missing: set  # model names nothing fills (transformers' ignore patterns removed)
    used: list  # the transforms that matched a key: saving reverts these, as transformers does


def load_plan(model: nn.Module, shapes: dict) -> LoadPlan:
    """Which checkpoint keys (`shapes`: key -> shape) fill which tensors of `model` (on meta or not),
    by transformers' renamings (chained), at most one converter per key, and the base-model prefix
    added or stripped, in the order transformers' `from_pretrained` applies them."""
    if not is_transformers_model(model):
        names = set(model.state_dict())
        return LoadPlan({k: k for k in shapes if k in names}, sorted(set(shapes) - names), names - set(shapes), [])
    T = transformers_internals()
    transforms = T.get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, T.WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, T.WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    state = model.state_dict()
    prefix = model.base_model_prefix
    sources, conversions, unexpected = {}, {}, []
    for key in sorted(shapes, key=T.dot_natural_key):
        name, pattern = T.rename_source_key(key, renamings, converters, prefix, state)
        if name not in state and key in state:  # a rename that should not have applied
            name, pattern = T.rename_source_key(key, [], [], prefix, state)
        if name not in state:
            unexpected.append(key)
        elif pattern is None:
            sources[name] = key
        else:
            conv = conversions.setdefault(name, Conversion(by_pattern[pattern], name))
            conv.keys.append((key, pattern))
    for conv in conversions.values():
        try:
            outs = conv.run(model, lambda k: torch.empty(shapes[k], device="meta"))  # names and shapes only
        except Exception as e:  # transformers' own message says which op, not which keys
            raise UsageError(
                f"transformers converts the checkpoint keys {[k for k, _ in conv.keys][:8]} into {conv.first!r} "
                f"with {conv.ops()}, which fails on their shapes "
                f"{[shapes[k] for k, _ in conv.keys][:8]}: {e}. Check that the checkpoint was written for "
                f"this config (transformers' from_pretrained refuses it too)") from e
        sources.update((n, conv) for n in outs if n in state)
    info = types.SimpleNamespace(missing_keys=set(state) - set(sources), unexpected_keys=set(unexpected))
    model._adjust_missing_and_unexpected_keys(info)  # transformers' ignore patterns (checked in transformers_internals)
    used = [t for t in transforms if t.was_used()]
    return LoadPlan(sources, sorted(info.unexpected_keys, key=T.dot_natural_key), info.missing_keys, used)


def keep_conversions(model: nn.Module, used: list) -> None:
    """Record the transforms a load used on `model`, where transformers' `from_pretrained` records them,
    so that a save writes the layout that was read (an old BERT file's `gamma` stays `gamma`)."""
    if is_transformers_model(model):
        model._weight_conversions = used


def save_names(model: nn.Module) -> list:
    """The state-dict names transformers' `save_pretrained` writes for a transformers `model`, before
    renaming: every parameter and persistent buffer, less `_keys_to_ignore_on_save`, one name per tied
    group (the one transformers keeps)."""
    state = model.state_dict()
    for key in model._keys_to_ignore_on_save or ():
        state.pop(key, None)
    return list(transformers_internals().remove_tied_weights_from_state_dict(state, model))


def save_groups(model: nn.Module, names: list) -> list:
    """`names` in groups that `revert` converts independently: a tensor that a reverse converter
    combines with others (the stacked experts split into one key each, gate and up joined into one
    fused key) is grouped with them; every other tensor is a group of its own."""
    if not is_transformers_model(model):
        return [[n] for n in names]
    T = transformers_internals()
    transforms = getattr(model, "_weight_conversions", None)
    if transforms is None:  # as revert_weight_conversion: the defaults, without legacy or prefix changes
        transforms = [t for t in T.get_model_conversion_mapping(model, add_legacy=False)
                      if not isinstance(t, T.PrefixChange)]
    converters = [t.reverse_transform() for t in transforms[::-1] if isinstance(t, T.WeightConverter)]
    groups: dict = {}
    for name in sorted(names, key=T.dot_natural_key):
        target, pattern = T.apply_converters(name, converters)
        groups.setdefault((target, True) if pattern is not None else (name, False), []).append(name)
    return list(groups.values())


def revert(model: nn.Module, tensors: dict) -> dict:
    """{checkpoint key: tensor} for one group's full tensors {model name: tensor}: transformers'
    `revert_weight_conversion`, the step its `save_pretrained` ends with."""
    if not is_transformers_model(model):
        return tensors
    return transformers_internals().revert_weight_conversion(model, tensors)


def is_peft_model(model) -> bool:
    """A `peft.PeftModel` (or subclass: PeftModelForCausalLM, ...), without importing peft."""
    return any(c.__module__.startswith("peft.") and c.__name__ == "PeftModel" for c in type(model).__mro__)


def aliases(pmodel) -> dict:
    """Canonical parameter name -> every name the source model has for the same tensor (tied weights)."""
    names: dict = {}
    by_id = {}
    for name, p in pmodel.source_model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    for group in by_id.values():
        for name in group:
            names.setdefault(name, group)
    return names
