"""`from_pretrained` and `save_pretrained`: a transformers checkpoint into a parallel model block by
block, and a parallel model out as the checkpoint its kind reads back (transformers', peft's, or a
plain module's own names). Built on `autopar.checkpoint.hf` (loading), `autopar.checkpoint.save`
(writing) and `autopar.checkpoint.adapters` (peft)."""

from __future__ import annotations

import os

from autopar.checkpoint import adapters
from autopar.checkpoint import keys as hf_keys
from autopar.checkpoint.hf import load_safetensors, meta_init, restore_buffers
from autopar.checkpoint.save import own_tensors, pipeline_tensors, save_view
from autopar.errors import UnsupportedError, UsageError

__all__ = ["from_pretrained", "save_pretrained"]


def from_pretrained(path: str, grid=(2, 2), example_inputs=(), example_kwargs=None, *, model_class=None,
                    adapter: str | None = None, progress: bool = True, **options):
    """Build a transformers model from `path`/config.json on the meta device, parallelize it, and read
    each rank's blocks from the safetensors weights in `path`. No rank materializes the whole model.
    `adapter`: a peft adapter's directory (adapter_config.json, adapter_model.safetensors, as peft's
    save_pretrained writes it): the model is wrapped as that adapter's peft model and its adapter
    weights are read too (`autopar.checkpoint.adapters`)."""
    import transformers

    from autopar.parallel.api import parallelize
    from autopar.program.build import check_example_inputs
    from autopar.program.device import model_device

    config = transformers.AutoConfig.from_pretrained(path)
    if model_class is None:
        archs = getattr(config, "architectures", None) or []
        if not archs or not hasattr(transformers, archs[0]):
            raise UsageError(f"{path}/config.json names no transformers architecture ({archs}); "
                             f"pass model_class=, e.g. transformers.LlamaForCausalLM")
        model_class = getattr(transformers, archs[0])
    with meta_init():
        model = model_class(config)
    restore_buffers(model, model_device(model, example_inputs, example_kwargs))  # the rotary tables: where it runs
    if adapter is not None:
        model = adapters.wrap(model, os.fspath(adapter))
    check_example_inputs(model, example_inputs if isinstance(example_inputs, tuple) else (example_inputs,),
                         example_kwargs, "autopar.from_pretrained")
    pm = parallelize(model, grid=grid, example_inputs=example_inputs, example_kwargs=example_kwargs, **options)
    if adapter is not None:
        adapters.load(pm, path, os.fspath(adapter), progress=progress)
    else:
        load_safetensors(pm, path, progress=progress)
    return pm


def save_pretrained(pmodel, path, max_shard_bytes: int = 2 * 2**30, merged: bool = False) -> None:
    """Write `pmodel` in HF format (config.json + safetensors) into directory `path`; call on every
    rank. Each parameter is gathered on its own (all ranks take part), and rank 0 holds at most one
    shard's tensors at a time. Other files in `path` are left alone. Any failure raises the same
    error on every rank and leaves the previous checkpoint's files in place (no temporary file stays).
    A second save into `path` while one runs (another job) is refused: the two would mix their files.

    A peft (LoRA) model: the adapter as peft writes it (adapter_model.safetensors, adapter_config.json)
    in `path`, and the base model under its own names in `path/base`; with `merged=True`, the base
    model with the adapter merged into its weights in `path` (what `merge_and_unload()` saves). See
    `autopar.checkpoint.adapters`."""
    path = os.fspath(path)
    if hf_keys.is_peft_model(pmodel.source_model) and hasattr(pmodel, "stage_modules"):
        raise UnsupportedError("save_pretrained of a pipelined peft model is not built; save it with "
                               "autopar.checkpoint.save_distributed, or parallelize it without pipeline=")
    if hf_keys.is_peft_model(pmodel.source_model):
        adapters.save(pmodel, path, max_shard_bytes, merged)
        return
    if merged:
        raise UsageError(f"save_pretrained(merged=True) merges a peft adapter into its base model; "
                         f"{type(pmodel.source_model).__name__} is not a peft model: leave merged out")
    if hasattr(pmodel, "stage_modules"):  # pipelined: each stage's tensors, sent to rank 0 by their stage
        save_view(pmodel, path, pmodel.source_model, pipeline_tensors(pmodel), max_shard_bytes)
        return
    save_view(pmodel, path, pmodel.source_model, own_tensors(pmodel), max_shard_bytes)
