"""Loading HF-format checkpoints without any rank holding the whole model.

- `meta_init()`: build a model on the meta device: no parameter is ever allocated at full size.
- `load_safetensors(pmodel, path)`: each rank reads only its blocks from the safetensors files (single
  file or index-sharded). Checkpoint keys are matched to the model's names by transformers' own rules
  (`autopar.checkpoint.keys`); a tensor transformers computes from several keys (stacked experts) is
  computed whole on each rank, one group at a time. `from_pretrained` (`autopar.checkpoint.pretrained`)
  builds the model on meta, parallelizes it and calls it.
- `load_full_state_dict(path)`: a checkpoint's full tensors on one process, for an unmodified model.
- Saving: `autopar.checkpoint.save`; torch.distributed.checkpoint: `autopar.checkpoint.dcp`.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import warnings

import torch
import torch.nn as nn

from autopar.parallel.sharded import grid_placements, replica_shard
from autopar.checkpoint import files as F
from autopar.checkpoint import keys as hf_keys
from autopar.checkpoint.dcp import load_distributed, save_distributed  # noqa: F401  (part of this API)
from autopar.checkpoint.safetensors_io import SafetensorsFile, check_dtype, open_regular
from passes.layout import chunk_range, parts, split_dim
from autopar.errors import CheckpointNotFoundError, CheckpointWarning, MissingWeightsError, UsageError

INDEX, SINGLE = F.INDEX, F.SINGLE



@contextlib.contextmanager
def meta_init():
    """Inside, tensors are created on the meta device: a model built here has shapes and no memory.
    Its buffers are on meta too; `restore_buffers` recomputes those of transformers models (rotary
    tables, position ids), and `parallelize` refuses a model whose buffers are still on meta."""
    with torch.device("meta"):
        yield


def restore_buffers(model: nn.Module, device="cpu") -> None:
    """Recompute the meta buffers of a transformers model the way transformers' own loading does:
    allocate them on `device` (where the model will run: its example inputs') and run the model's
    `_init_weights` on their module (on a module's meta parameters that is a no-op)."""
    init = getattr(model, "_init_weights", None)
    for module in model.modules():
        metas = [n for n, b in module.named_buffers(recurse=False) if b is not None and b.is_meta]
        if not metas:
            continue
        if init is None:
            raise UsageError(f"buffers {metas} of {type(module).__name__} are on the meta device and "
                             f"{type(model).__name__} has no _init_weights to recompute them")
        for n in metas:
            module._buffers[n] = torch.empty_like(module._buffers[n], device=device)
        with torch.no_grad():
            init(module)


def block_ranges(shape, placements, grid) -> list:
    """Per dim, the (start, stop) ranges of the global tensor this rank's block is made of
    (several for an interleaved split: one per part, concatenated in order; a torch.chunk block, as
    DTensor's, for a dim the grid does not divide)."""
    ranges = [[(0, n)] for n in shape]
    for axis, p in enumerate(placements):
        d = split_dim(p)
        if d is None:
            continue
        k, i = parts(p), grid.index(axis)
        if k == 1:
            (a, b), = ranges[d]
            lo, hi = chunk_range(b - a, grid.size(axis), i)
            ranges[d] = [(a + lo, a + hi)]
            continue
        new = []
        for a, b in ranges[d]:
            part = (b - a) // k
            for j in range(k):
                n = part // grid.size(axis)
                new.append((a + j * part + i * n, a + j * part + (i + 1) * n))
        ranges[d] = new
    return ranges


def _read_block(read, ranges: list) -> torch.Tensor:
    """Concatenate `read(chosen)` over every combination of ranges (one (start, stop) per dim), dim by dim."""
    def rec(d, chosen):
        if d == len(ranges):
            return read(chosen)
        pieces = [rec(d + 1, chosen + [r]) for r in ranges[d]]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, d)
    return rec(0, [])


def checkpoint_files(path: str) -> dict:
    """Checkpoint key -> safetensors file path."""
    index = os.path.join(path, INDEX)
    if os.path.exists(index):
        return {k: _inside(path, index, k, v) for k, v in _weight_map(index).items()}
    single = os.path.join(path, SINGLE)
    if not os.path.exists(single):
        raise CheckpointNotFoundError(f"{path}: neither {SINGLE} nor {INDEX} found; expected a directory "
                                      f"written by save_pretrained (config.json and safetensors weights)")
    f = SafetensorsFile(single)
    keys = list(f.keys())
    f.close()
    return {k: single for k in keys}


def _one_file(path: str) -> dict:
    f = SafetensorsFile(path)
    keys = list(f.keys())
    f.close()
    return {k: path for k in keys}


def _weight_map(index: str) -> dict:
    try:
        with os.fdopen(open_regular(index)) as fh:  # not a FIFO, whose open would block
            weight_map = json.load(fh).get("weight_map")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
        raise UsageError(f"{index}: not a JSON object with a 'weight_map' ({e}); re-save the checkpoint") from None
    if not (isinstance(weight_map, dict) and all(isinstance(v, str) for v in weight_map.values())):
        raise UsageError(f"{index}: 'weight_map' must map tensor names to file names, got "
                         f"{type(weight_map).__name__}; re-save the checkpoint")
    return weight_map


def _inside(path: str, index: str, key: str, name: str) -> str:
    """`path`/`name`, refused unless it names a file inside `path`. The index is what a downloaded
    checkpoint could forge, so '..', absolute names and symlinked subdirectories are refused; a file
    symlink in `path` itself is followed (the Hugging Face hub cache stores every file that way)."""
    full = os.path.join(path, name)
    parent = os.path.realpath(os.path.dirname(full))
    root = os.path.realpath(path)
    if os.path.isabs(name) or ".." in name.replace("\\", "/").split("/") or \
            os.path.commonpath([root, parent]) != root:
        raise UsageError(f"{index}: weight_map[{key!r}] = {name!r} points outside the checkpoint directory "
                         f"{path}; an index may only name files inside it (re-save the checkpoint, or fix "
                         f"the index if you trust its source)")
    return full


def load_safetensors(pmodel, path: str, progress: bool = True) -> None:
    """Fill every parameter (and persistent buffer) of `pmodel` with its block from `path`. Checkpoint
    keys are matched to the model's names by transformers' own rules (`autopar.checkpoint.keys`): renamed
    keys, a base model's checkpoint for a model with a head (or the reverse), tied names. A tensor that
    transformers computes from several keys (stacked experts, a split fused projection) is computed
    whole on every rank, then cut to the rank's block. A peft model reads its base model's checkpoint
    and its adapter: `autopar.checkpoint.adapters.load`."""
    if hf_keys.is_peft_model(pmodel.source_model):
        raise UsageError(f"load_safetensors({path!r}): this is a peft model, whose base weights and adapter are "
                         f"two checkpoints: autopar.from_pretrained(base_path, adapter=adapter_path, ...), or "
                         f"autopar.checkpoint.adapters.load(pmodel, base_path, adapter_path)")
    load_view(pmodel, path, pmodel.source_model, None, progress)


def load_view(pmodel, path: str, source, names: dict | None, progress: bool = True,
              file: str | None = None) -> None:
    """load_safetensors for the tensors `names` maps (name in `source`'s checkpoint -> `pmodel`'s name;
    None: every tensor of `pmodel`, `source` being its source model). `source` None: the keys are the
    names themselves (a peft adapter's file). `file`: read that one safetensors file in `path`
    (adapter_model.safetensors) instead of the model's."""
    files = checkpoint_files(path) if file is None else _one_file(os.path.join(path, file))
    handles: dict = {}

    def handle(key):
        return handles.get(files[key]) or handles.setdefault(files[key], SafetensorsFile(files[key]))

    def read_whole(key):
        f = handle(key)
        return f.read(key, [(0, n) for n in f.shape(key)])

    bar = None
    try:
        todo = _sources(pmodel, path, {k: tuple(handle(k).shape(k)) for k in files}, source, names)
        bar = _progress(len(todo), pmodel.grid.rank == 0 and progress)
        converted: dict = {}  # model name -> whole tensor computed by a conversion, until its block is read
        for _name, tensor, (alias, src) in todo:
            placed = grid_placements(tensor)  # over the grid, or a 3D linear's weight over its cube
            ranges = block_ranges(tuple(tensor.shape), placed, pmodel.grid.cube if len(placed) == 3 else pmodel.grid)
            if isinstance(src, str):
                _check_shape(path, src, handle(src).shape(src), tensor)
                check_dtype(files[src], src, handle(src).dtype(src), tensor.dtype)
                block = _read_block(functools.partial(handle(src).read, src), ranges)
            else:
                if alias not in converted:
                    converted.update(src.run(source, read_whole))
                whole = converted.pop(alias)
                what = f"{alias} (computed by {src.ops()} from {len(src.keys)} keys)"
                _check_shape(path, what, whole.shape, tensor)
                check_dtype(path, what, whole.dtype, tensor.dtype)
                block = _read_block(lambda chosen, whole=whole: whole[tuple(slice(a, b) for a, b in chosen)], ranges)
            local = tensor.to_local() if getattr(tensor, "placements", ()) else tensor
            with torch.no_grad():  # sharded replicas: this rank's part of its grid block
                local.copy_(replica_shard(tensor, block, pmodel.grid.dp_index, pmodel.grid.dp))
            bar.update(1)
    finally:
        if bar is not None:
            bar.close()
        for f in handles.values():
            f.close()
    pmodel.materialized = True


def _sources(pmodel, path: str, shapes: dict, source, names: dict | None) -> list:
    """[(name, tensor, (checkpoint name, key or Conversion))] for every parameter and persistent buffer
    of `pmodel` that the checkpoint fills (those `names` maps, when given). A parameter it does not fill
    is refused (transformers would initialize it at random); a buffer keeps the value the model
    computed, with a warning."""
    if source is None:
        plan = hf_keys.LoadPlan({k: k for k in shapes if k in names}, sorted(set(shapes) - set(names)),
                                set(names) - set(shapes), [])
    else:
        plan = hf_keys.load_plan(source, shapes)
        hf_keys.keep_conversions(source, plan.used)
    if names is None:
        aliases = hf_keys.aliases(pmodel)
    else:  # pmodel's name -> the names it has in the checkpoint's model (a tied pair has two)
        aliases = {}
        for own_name, mine in names.items():
            aliases.setdefault(mine, []).append(own_name)
    todo, missing, kept = [], [], []
    buffers = [(n, b) for n, b in pmodel.named_buffers() if n in pmodel.persistent_buffer_names]
    for is_param, items in ((True, pmodel.named_parameters()), (False, buffers)):
        for name, tensor in items:
            if names is not None and name not in aliases:
                continue  # filled from another checkpoint (a peft model's base or adapter)
            src = next(((a, plan.sources[a]) for a in aliases.get(name, [name]) if a in plan.sources), None)
            if src is not None:
                todo.append((name, tensor, src))
            elif is_param:
                missing.append(name)
            elif name in plan.missing:  # not covered by the model's _keys_to_ignore_on_load_missing
                kept.append(name)
    if missing:
        of = type(source if source is not None else pmodel.source_model).__name__
        raise MissingWeightsError(
            f"{path}: the checkpoint holds no tensor for {len(missing)} parameter(s) of "
            f"{of}: {missing[:8]}{' ...' if len(missing) > 8 else ''}; checkpoint keys "
            f"that fill nothing: {plan.unexpected[:8]}{' ...' if len(plan.unexpected) > 8 else ''}. "
            f"autopar does not initialize missing parameters at random as transformers does: load a checkpoint "
            f"of this architecture (config.json's `architectures`, or pass model_class=)")
    if pmodel.grid.rank == 0 and (kept or plan.unexpected):
        warnings.warn(
            f"autopar.load_safetensors({path!r}): {len(plan.unexpected)} checkpoint key(s) fill nothing and "
            f"were skipped: {plan.unexpected[:8]}{' ...' if len(plan.unexpected) > 8 else ''}; "
            f"{len(kept)} buffer(s) not in the checkpoint keep the values the model computed: {kept[:8]}",
            CheckpointWarning, stacklevel=3)
    return todo


def _check_shape(path: str, what: str, shape, tensor) -> None:
    if tuple(shape) != tuple(tensor.shape):
        raise UsageError(f"{path}: {what} has shape {tuple(shape)}, the model expects {tuple(tensor.shape)}; "
                         f"check that config.json matches the weights")


def _progress(total: int, enabled: bool):
    try:
        from tqdm.auto import tqdm
    except ImportError:  # progress bars are optional
        enabled = False
    if not enabled:
        class _Null:
            def update(self, n):
                pass

            def close(self):
                pass
        return _Null()
    return tqdm(total=total, desc="autopar: loading shards", unit="tensor", delay=3)


def load_full_state_dict(path: str) -> dict:
    """The full tensors of a checkpoint `save_pretrained` wrote (one `model.safetensors`, or the shards
    its index lists), as a plain state_dict for the unmodified model on one process, no process group
    needed: `MyModel().load_state_dict(autopar.load_full_state_dict(path))`. For a plain nn.Module the
    keys are its own state_dict's, tied names included; a transformers model's file is read by its
    own `from_pretrained(path)` (the keys are transformers' checkpoint keys)."""
    path = os.fspath(path)
    files = checkpoint_files(path)
    out: dict = {}
    for file in dict.fromkeys(files.values()):
        f = SafetensorsFile(file)
        try:
            for key in f.keys():
                if files.get(key) == file:
                    out[key] = f.read(key, [(0, n) for n in f.shape(key)])
        finally:
            f.close()
    return out


