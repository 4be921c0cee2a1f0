"""peft (LoRA) models: checkpoints that peft and transformers read, and a base model plus an adapter
loaded block by block.

A parallelized `peft.get_peft_model(model, LoraConfig(...))` holds the base model's parameters under
`base_model.model.<name>` (a LoRA-wrapped layer's weight as `<layer>.base_layer.weight`) and the
adapter's as `<layer>.lora_A.<adapter>.weight`. A checkpoint of it is two things, as peft keeps them:

- `save(pmodel, path)`: the adapter as `peft_model.save_pretrained(path)` writes it
  (`adapter_model.safetensors` under peft's keys, the adapter name removed, and `adapter_config.json`
  from peft's own config), and the base model under its own names in `path/base` (`config.json` and
  safetensors, as transformers writes it). One process reads them back with
  `PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(f"{path}/base"), path)`.
- `save(..., merged=True)`: the base model with each LoRA update merged into its weight
  (W + scaling · B @ A, transposed for a fan-in-fan-out layer), in `path`: what
  `peft_model.merge_and_unload().save_pretrained(path)` writes, which transformers loads alone.
- `load(pmodel, base_path, adapter_path)`: each rank reads its blocks of the base weights (by
  transformers' key rules) and of the adapter (peft's keys): what `autopar.from_pretrained(base_path,
  adapter=adapter_path)` does after building the model on the meta device.

Only LoRA adapters are merged (`merged=True` refuses other kinds, naming them); any adapter kind is
saved and loaded under peft's keys.
"""

from __future__ import annotations

import os

import torch

from autopar.checkpoint.hf import load_view, meta_init
from autopar.checkpoint.keys import is_peft_model
from autopar.checkpoint.save import save_view
from autopar.errors import UsageError
from autopar.program.consensus import AXES, agree, on_rank0
from passes.ops.comm import guarded

__all__ = ["is_peft_model", "save", "load", "names"]

PREFIX = "base_model.model."  # where a PeftModel keeps the wrapped model's names


def _adapter(model) -> str:
    name = model.active_adapter
    if not isinstance(name, str):  # several active adapters
        raise UsageError(f"a peft model with several active adapters ({name}) cannot be saved as one adapter: "
                         f"set_adapter(one) first")
    return name


def names(pmodel) -> tuple:
    """({base model name: pmodel name}, {adapter checkpoint key: pmodel name}) of a parallelized peft
    model: a name holding `.<adapter>.` is the adapter's (its key drops that segment, as peft's
    `get_peft_model_state_dict` does); another is the base model's, less `base_model.model.` and a
    LoRA layer's `.base_layer` (a `modules_to_save` layer's `.original_module`). Tied names included."""
    adapter = _adapter(pmodel.source_model)
    own = [n for n, _ in pmodel.named_parameters()]
    own += [n for n, _ in pmodel.named_buffers() if n in pmodel.persistent_buffer_names]
    own += list(pmodel.tied_names)
    base, adapted = {}, {}
    for name in own:
        if f".{adapter}." in name:
            adapted[name.replace(f".{adapter}", "")] = name
        elif name.startswith(PREFIX):
            base[name[len(PREFIX):].replace(".base_layer", "").replace(".original_module", "")] = name
    return base, adapted


def _base_model(pmodel):
    return pmodel.source_model.get_base_model()


def save(pmodel, path: str, max_shard_bytes: int, merged: bool) -> None:
    """See the module docstring. Every rank calls it; gathers go parameter by parameter."""
    base_model = _base_model(pmodel)
    base, adapted = names(pmodel)
    tensors = _by_name(pmodel)
    keep = _save_names(base_model, _adapter(pmodel.source_model))
    if merged:
        merge = _merger(pmodel, tensors)
        save_view(pmodel, path, base_model, {n: tensors[base[n]] for n in keep}, max_shard_bytes,
                  merge=lambda n, full: merge(base[n], full))
        return
    save_view(pmodel, os.path.join(path, "base"), base_model, {n: tensors[base[n]] for n in keep}, max_shard_bytes)
    full = {}
    for key, name in adapted.items():  # small: gathered whole, written by rank 0
        t = tensors[name]
        with guarded(pmodel.grid, "full_tensor gather", AXES, f"save_pretrained: {name}"):
            whole = t.full_tensor() if hasattr(t, "full_tensor") else t
        full[key] = whole.detach().cpu().contiguous()
    agree(pmodel.grid, on_rank0(pmodel.grid, _write_adapter, pmodel.source_model, path, full),
          f"autopar.save_pretrained({path!r}): writing the adapter")


def _save_names(base_model, adapter: str) -> list:
    """The names the base model's checkpoint holds: what it saves (transformers' rules: one name per
    tied pair), its adapter's tensors left out and a wrapped layer's `.base_layer` taken out (peft
    injected its layers into the base model in place)."""
    from autopar.checkpoint import keys as hf_keys

    transformers_model = hf_keys.is_transformers_model(base_model)
    saved = hf_keys.save_names(base_model) if transformers_model else list(base_model.state_dict())
    clean = (n.replace(".base_layer", "").replace(".original_module", "") for n in saved if f".{adapter}." not in n)
    return list(dict.fromkeys(clean))


def _by_name(pmodel) -> dict:
    out = dict(pmodel.named_parameters())
    out.update((n, b) for n, b in pmodel.named_buffers() if n in pmodel.persistent_buffer_names)
    out.update((other, out[own]) for other, own in pmodel.tied_names.items())
    return out


def _write_adapter(model, path: str, full: dict) -> None:
    """Rank 0: adapter_model.safetensors and adapter_config.json as peft writes them (its own config
    serializer), each through a temporary name."""
    from autopar.checkpoint import files as F
    from autopar.checkpoint.safetensors_io import write

    os.makedirs(path, exist_ok=True)
    config = model.peft_config[_adapter(model)]
    tmp = F.temp_path(path, "adapter_model.safetensors")
    write(tmp, full, {"format": "pt"})
    os.replace(tmp, os.path.join(path, "adapter_model.safetensors"))
    was = config.inference_mode
    config.inference_mode = True  # as peft's save_pretrained writes it
    try:
        config.save_pretrained(path)  # peft's own serializer: adapter_config.json
    finally:
        config.inference_mode = was


def _merger(pmodel, tensors: dict):
    """merge(pmodel name of a base weight, its full tensor on rank 0) -> the weight to write: with a
    LoRA layer's update added (its A and B gathered, on every rank); others unchanged."""
    source = pmodel.source_model
    adapter = _adapter(source)
    layers = {}
    for path, module in source.named_modules():
        if hasattr(module, "lora_A") and hasattr(module, "base_layer"):
            layers[f"{path}.base_layer.weight"] = module
        elif hasattr(module, "base_layer") and not hasattr(module, "lora_A"):
            raise UsageError(f"save_pretrained(merged=True): {path} is a {type(module).__name__}, not a LoRA "
                             f"layer; only LoRA adapters are merged here: save without merged=True")

    def merge(name: str, full):
        module = layers.get(name)
        if module is None or adapter not in module.lora_A:
            return full
        path = name[:-len(".base_layer.weight")]
        parts = []
        for which in ("lora_A", "lora_B"):
            t = tensors[f"{path}.{which}.{adapter}.weight"]
            with guarded(pmodel.grid, "full_tensor gather", AXES, f"save_pretrained: {path}.{which}"):
                parts.append(t.full_tensor() if hasattr(t, "full_tensor") else t)
        if full is None:  # not rank 0: it took part in the gathers only
            return None
        a, b = (p.detach().cpu().float() for p in parts)
        if a.dim() != 2 or b.dim() != 2:
            raise UsageError(f"save_pretrained(merged=True): {path}'s LoRA weights are not matrices "
                             f"(a {type(module.base_layer).__name__}); save without merged=True")
        delta = (b @ a) * float(module.scaling[adapter])
        if getattr(module, "fan_in_fan_out", False):
            delta = delta.T
        return (full.float() + delta).to(full.dtype).contiguous()

    return merge


def load(pmodel, base_path: str, adapter_path: str, progress: bool = True) -> None:
    """Each rank's blocks of the base model's weights from `base_path` (transformers' key rules) and of
    the adapter from `adapter_path` (peft's keys)."""
    base, adapted = names(pmodel)
    # transformers' key rules are asked about the base model as it was before peft injected its layers
    # (a `q_proj.base_layer.weight` is the checkpoint's `q_proj.weight`): one more copy, on meta
    injected = _base_model(pmodel)
    with meta_init():
        model_class = type(injected)
        clean = model_class(injected.config) if hasattr(injected, "config") else None
    if clean is None:
        raise UsageError(f"autopar loads a peft adapter over a transformers base model; "
                         f"{type(injected).__name__} has no config to rebuild it from")
    load_view(pmodel, base_path, clean, base, progress)
    weights = os.path.join(adapter_path, "adapter_model.safetensors")
    if not os.path.isfile(weights):
        raise UsageError(f"{adapter_path}: no adapter_model.safetensors, which peft's save_pretrained writes "
                         f"(and autopar.save_pretrained of a peft model); pass the adapter's directory")
    load_view(pmodel, adapter_path, None, adapted, progress, file="adapter_model.safetensors")


def wrap(model, adapter_path: str):
    """`model` (built on the meta device) as the peft model `adapter_path`'s config describes, with its
    adapter modules on the meta device too: their values come from the adapter file."""
    import peft

    config = peft.PeftConfig.from_pretrained(adapter_path)
    config.inference_mode = False  # trainable, as get_peft_model leaves a new adapter
    with torch.device("meta"):
        return peft.get_peft_model(model, config)
