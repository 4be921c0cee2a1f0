"""Loading and saving HF-format checkpoints without any rank holding the whole model.

- `meta_init()`: build a model on the meta device: no parameter is ever allocated at full size.
- `from_pretrained(path, grid, ...)`: config.json -> model on meta -> `parallelize` -> each rank reads
  only its blocks from the safetensors files (single file or index-sharded). Checkpoint keys are
  matched to the model's names by transformers' own rules (`autopar.checkpoint.keys`); a tensor transformers
  computes from several keys (stacked experts) is computed whole on each rank, one group at a time.
- `save_pretrained(pmodel, path)`: parameters gathered one at a time, written by rank 0 into
  safetensors shards of at most `max_shard_bytes` under the keys transformers writes, with
  config.json. Only the files it writes are replaced (each atomically, after every shard is
  complete), so other files in `path` survive and an interrupted save leaves the previous checkpoint
  loadable. Every rank agrees on each step's outcome, so a failure on rank 0 alone raises on all
  ranks instead of leaving them waiting in a gather.
- `save_distributed` / `load_distributed` (autopar.checkpoint.dcp): torch.distributed.checkpoint
  of the model (and optimizer), saved to a fresh directory swapped in when every rank finished.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import warnings

import torch
import torch.nn as nn

from autopar.checkpoint import files as F
from autopar.checkpoint import keys as hf_keys
from autopar.program.consensus import AXES, agree, on_rank0
from autopar.checkpoint.dcp import load_distributed, save_distributed  # noqa: F401  (part of this API)
from autopar.checkpoint.safetensors_io import SafetensorsFile, check_dtype, open_regular, write
from passes.layout import chunk_range, parts, split_dim
from passes.ops.comm import guarded
from autopar.errors import CheckpointNotFoundError, CheckpointWarning, MissingWeightsError, UsageError

INDEX, SINGLE = F.INDEX, F.SINGLE



@contextlib.contextmanager
def meta_init():
    """Inside, tensors are created on the meta device: a model built here has shapes and no memory.
    Its buffers are on meta too; `restore_buffers` recomputes those of transformers models (rotary
    tables, position ids), and `parallelize` refuses a model whose buffers are still on meta."""
    with torch.device("meta"):
        yield


def restore_buffers(model: nn.Module) -> None:
    """Recompute the meta buffers of a transformers model the way transformers' own loading does:
    allocate them on the CPU and run the model's `_init_weights` on their module (on a module's meta
    parameters that is a no-op)."""
    init = getattr(model, "_init_weights", None)
    for module in model.modules():
        metas = [n for n, b in module.named_buffers(recurse=False) if b is not None and b.is_meta]
        if not metas:
            continue
        if init is None:
            raise UsageError(f"buffers {metas} of {type(module).__name__} are on the meta device and "
                             f"{type(model).__name__} has no _init_weights to recompute them")
        for n in metas:
            module._buffers[n] = torch.empty_like(module._buffers[n], device="cpu")
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


def _aliases(pmodel) -> dict:
    """Canonical parameter name -> every name the source model has for the same tensor (tied weights)."""
    names: dict = {}
    by_id = {}
    for name, p in pmodel.source_model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    for group in by_id.values():
        for name in group:
            names.setdefault(name, group)
    return names


def load_safetensors(pmodel, path: str, progress: bool = True) -> None:
    """Fill every parameter (and persistent buffer) of `pmodel` with its block from `path`. Checkpoint
    keys are matched to the model's names by transformers' own rules (`autopar.checkpoint.keys`): renamed
    keys, a base model's checkpoint for a model with a head (or the reverse), tied names. A tensor that
    transformers computes from several keys (stacked experts, a split fused projection) is computed
    whole on every rank, then cut to the rank's block. A peft model reads its base model's checkpoint
    and its adapter: `autopar.checkpoint.adapters.load`."""
    from autopar.checkpoint import adapters

    if adapters.is_peft_model(pmodel.source_model):
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
            ranges = block_ranges(tuple(tensor.shape), getattr(tensor, "placements", ()), pmodel.grid)
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
            with torch.no_grad():
                local.copy_(block)
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
        aliases = _aliases(pmodel)
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

    config = transformers.AutoConfig.from_pretrained(path)
    if model_class is None:
        archs = getattr(config, "architectures", None) or []
        if not archs or not hasattr(transformers, archs[0]):
            raise UsageError(f"{path}/config.json names no transformers architecture ({archs}); "
                             f"pass model_class=, e.g. transformers.LlamaForCausalLM")
        model_class = getattr(transformers, archs[0])
    with meta_init():
        model = model_class(config)
    restore_buffers(model)
    if adapter is not None:
        from autopar.checkpoint import adapters

        model = adapters.wrap(model, os.fspath(adapter))
    check_example_inputs(model, example_inputs if isinstance(example_inputs, tuple) else (example_inputs,),
                         example_kwargs, "autopar.from_pretrained")
    pm = parallelize(model, grid=grid, example_inputs=example_inputs, example_kwargs=example_kwargs, **options)
    if adapter is not None:
        adapters.load(pm, path, os.fspath(adapter), progress=progress)
    else:
        load_safetensors(pm, path, progress=progress)
    return pm


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


def _own_tensors(pmodel) -> dict:
    """(name -> tensor of every saved parameter and persistent buffer): a transformers model the names
    its own save_pretrained saves; another model every name its state_dict has (a tied one included:
    its load_state_dict is strict)."""
    source = pmodel.source_model
    own = dict(pmodel.named_parameters())
    own.update((n, b) for n, b in pmodel.named_buffers() if n in pmodel.persistent_buffer_names)
    if hf_keys.is_transformers_model(source):
        aliases = _aliases(pmodel)
        return {n: own[n] if n in own else own[aliases[n][0]] for n in hf_keys.save_names(source)}
    tied = pmodel.tied_names
    return {n: own[tied.get(n, n)] for n in source.state_dict(keep_vars=True) if tied.get(n, n) in own}


def _shards(source, tensors: dict, max_shard_bytes: int) -> list:
    """[[[names of a group] of shard i]]: a transformers model's names in groups that convert back to
    checkpoint keys together (`hf_keys.save_groups`); another model's each alone."""
    shards, cur, cur_bytes = [], [], 0
    for group in hf_keys.save_groups(source, list(tensors)):
        size = sum(tensors[n].numel() * tensors[n].element_size() for n in group)
        if cur and cur_bytes + size > max_shard_bytes:
            shards.append(cur)
            cur, cur_bytes = [], 0
        cur.append(group)
        cur_bytes += size
    if cur:
        shards.append(cur)
    return shards


def _config_json(source) -> dict | None:
    """config.json's content, naming the source model's class in `architectures` (as transformers'
    save_pretrained does, even when the config named another class: a LlamaModel loaded from a
    LlamaForCausalLM file saves as LlamaModel), so that `from_pretrained(path)` needs no model_class=."""
    config = getattr(source, "config", None)
    if config is None or not hasattr(config, "to_json_string"):
        return None
    content = json.loads(config.to_json_string(use_diff=True))
    content["architectures"] = [type(source).__name__]
    return content


def _clean_on_error(grid, written: list, lock, fn, *args):
    """`on_rank0(fn)`; on failure the temporary files are removed and the lock released before the
    ranks learn of it, so when any rank has raised, neither is left."""
    err = on_rank0(grid, fn, *args)
    if err is not None:
        F.remove_quietly(written)
        lock.release()
    return err


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
    from autopar.checkpoint import adapters

    path = os.fspath(path)
    if adapters.is_peft_model(pmodel.source_model):
        adapters.save(pmodel, path, max_shard_bytes, merged)
        return
    if merged:
        raise UsageError(f"save_pretrained(merged=True) merges a peft adapter into its base model; "
                         f"{type(pmodel.source_model).__name__} is not a peft model: leave merged out")
    save_view(pmodel, path, pmodel.source_model, _own_tensors(pmodel), max_shard_bytes)


def save_view(pmodel, path: str, source, tensors: dict, max_shard_bytes: int, merge=None) -> None:
    """save_pretrained of `tensors` (checkpoint name in `source` -> a tensor of `pmodel`) as `source`'s
    checkpoint. `merge(name, full)` (rank 0, the full tensor) gives what is written for a name (a peft
    base weight with its adapter's update added)."""
    grid = pmodel.grid
    what = f"autopar.save_pretrained({path!r})"
    lock = F.SaveLock(os.path.join(path, ".autopar-save" + F.LOCK), f"save_pretrained into {path!r}")
    try:
        agree(grid, _clean_on_error(grid, [], lock, F.check_target, path, lock), f"{what}: checking the target")
        _save(pmodel, grid, path, what, max_shard_bytes, lock, source, tensors, merge)
    finally:
        lock.release()


def _save(pmodel, grid, path: str, what: str, max_shard_bytes: int, lock, source, tensors, merge) -> None:
    shards = _shards(source, tensors, max_shard_bytes)
    index = {"metadata": {"total_size": 0}, "weight_map": {}}  # filled on rank 0
    written = []  # temporary files on rank 0
    names = F.shard_names(path, len(shards))  # rank 0's are the ones written (it alone reads the directory)
    try:
        for i, shard in enumerate(shards):
            fname = names[i]
            gathered = []
            for group in shard:
                full = {}
                for n in group:
                    t = tensors[n]
                    with guarded(grid, "full_tensor gather", AXES, f"save_pretrained: {n}"):
                        whole = t.full_tensor() if hasattr(t, "full_tensor") else t  # every rank calls it
                    if grid.rank == 0:
                        full[n] = whole.detach().cpu().contiguous()
                    if merge is not None:
                        merged = merge(n, full.get(n))  # gathers of its own on every rank (an adapter's A, B)
                        if grid.rank == 0:
                            full[n] = merged
                    del whole
                gathered.append(full)
            written.append(F.temp_path(path, fname))
            err = _clean_on_error(grid, written, lock, _write_shard, written[-1], fname, gathered, source, index)
            agree(grid, err, f"{what}: writing shard {i + 1} of {len(shards)}")
        agree(grid, _clean_on_error(grid, written, lock, _finish, path, names, index, _config_json(source), lock),
              f"{what}: finishing")
    finally:  # a failed collective: nothing was agreed, rank 0 still cleans up
        if grid.rank == 0:
            F.remove_quietly(written)


def _write_shard(tmp: str, fname: str, gathered: list, source, index: dict) -> None:
    """Rank 0: each gathered group under the keys transformers' save_pretrained writes for it
    (`hf_keys.revert`), written into `tmp` and recorded in `index`."""
    block = {}
    while gathered:  # each group's gathered tensors are dropped once converted: one shard and one group at most
        block.update((k, t.contiguous()) for k, t in hf_keys.revert(source, gathered.pop(0)).items())
    write(tmp, block, {"format": "pt"})
    index["weight_map"].update(dict.fromkeys(block, fname))
    index["metadata"]["total_size"] += sum(t.numel() * t.element_size() for t in block.values())


def _finish(path: str, names: list, index: dict, config: dict | None, lock) -> None:
    """`_switch`, then the lock released: before the ranks return, so that none sees it left behind."""
    try:
        _switch(path, names, index, config)
    finally:
        lock.release()


def _switch(path: str, names: list, index: dict, config: dict | None) -> None:
    """Switch `path` from the checkpoint there to the new one, so that a reader (or a kill) at any point
    sees one complete checkpoint: move the new shards into place under names the old one does not use
    (`F.shard_names`), then rename the index into place (the switch: the old index named only old
    shards, the new one only new), then config.json; only then remove the previous checkpoint's weight
    files that the new one does not list (an index first, before the shards it names). A failure
    before the switch removes the new shards again and leaves the old checkpoint as it was."""
    previous = F.previous_weights(path)
    moved = []
    try:
        for name in names:
            os.replace(F.temp_path(path, name), os.path.join(path, name))
            moved.append(name)
        F.fsync_dir(path)
        if len(names) > 1:
            _write_json(path, INDEX, index)
    except BaseException:
        F.remove_quietly(os.path.join(path, n) for n in moved if n not in previous)
        raise
    if config is not None:
        _write_json(path, "config.json", config)
    if len(names) == 1 and os.path.isfile(os.path.join(path, INDEX)):
        os.remove(os.path.join(path, INDEX))  # the old index named shards; a loader now reads model.safetensors
    for name in previous:
        if name not in names:
            os.remove(os.path.join(path, name))
    F.fsync_dir(path)


def _write_json(path: str, name: str, content: dict) -> None:
    tmp = F.temp_path(path, name)
    try:
        with open(tmp, "w") as fh:
            json.dump(content, fh, indent=2, sort_keys=True)
            fh.write("\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, os.path.join(path, name))
    finally:
        F.remove_quietly([tmp])
