"""Loading and saving HF-format checkpoints without any rank holding the whole model.

- `meta_init()`: build a model on the meta device: no parameter is ever allocated at full size.
- `from_pretrained(path, grid, ...)`: config.json -> model on meta -> `parallelize` -> each rank reads
  only its blocks from the safetensors files (single file or index-sharded).
- `save_pretrained(pmodel, path)`: parameters gathered one at a time, written by rank 0 into
  safetensors shards of at most `max_shard_bytes`, with config.json, into a temporary directory that
  replaces `path` only when complete (an interrupted save leaves the previous checkpoint intact).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from autopar.safetensors_io import SafetensorsFile, write
from passes.layout import parts, split_dim

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


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
            raise ValueError(f"buffers {metas} of {type(module).__name__} are on the meta device and "
                             f"{type(model).__name__} has no _init_weights to recompute them")
        for n in metas:
            module._buffers[n] = torch.empty_like(module._buffers[n], device="cpu")
        with torch.no_grad():
            init(module)


def block_ranges(shape, placements, grid) -> list:
    """Per dim, the (start, stop) ranges of the global tensor this rank's block is made of
    (several for an interleaved split: one per part, concatenated in order)."""
    ranges = [[(0, n)] for n in shape]
    for axis, p in enumerate(placements):
        d = split_dim(p)
        if d is None:
            continue
        k, i = parts(p), grid.index(axis)
        new = []
        for a, b in ranges[d]:
            part = (b - a) // k
            for j in range(k):
                n = part // grid.size(axis)
                new.append((a + j * part + i * n, a + j * part + (i + 1) * n))
        ranges[d] = new
    return ranges


def _read_block(f: SafetensorsFile, key: str, ranges: list) -> torch.Tensor:
    """Concatenate the reads of every combination of ranges, dim by dim."""
    def rec(d, chosen):
        if d == len(ranges):
            return f.read(key, chosen)
        pieces = [rec(d + 1, chosen + [r]) for r in ranges[d]]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, d)
    return rec(0, [])


def _files(path: str) -> dict:
    """Checkpoint key -> safetensors file path."""
    index = os.path.join(path, INDEX)
    if os.path.exists(index):
        with open(index) as fh:
            return {k: os.path.join(path, v) for k, v in json.load(fh)["weight_map"].items()}
    single = os.path.join(path, SINGLE)
    if not os.path.exists(single):
        raise FileNotFoundError(f"{path}: neither {SINGLE} nor {INDEX} found; expected a directory written by "
                                f"save_pretrained (config.json and safetensors weights)")
    f = SafetensorsFile(single)
    keys = list(f.keys())
    f.close()
    return {k: single for k in keys}


def _aliases(pmodel) -> dict:
    """Canonical parameter name -> every name the source model has for the same tensor (tied weights)."""
    names: dict = {}
    by_id = {}
    for name, p in pmodel._source.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    for group in by_id.values():
        for name in group:
            names.setdefault(name, group)
    return names


def load_safetensors(pmodel, path: str, progress: bool = True) -> None:
    """Fill every parameter (and persistent buffer) of `pmodel` with its block from `path`."""
    files = _files(path)
    aliases = _aliases(pmodel)
    handles: dict = {}
    items = list(pmodel.named_parameters()) + [(n, b) for n, b in pmodel.named_buffers() if n in files]
    bar = _progress(len(items), pmodel.grid.rank == 0 and progress)
    try:
        for name, tensor in items:
            key = next((a for a in aliases.get(name, [name]) if a in files), None)
            if key is None:
                raise KeyError(f"{path}: no tensor for parameter {name!r} (also tried {aliases.get(name, [])}); "
                               f"the checkpoint has e.g. {sorted(files)[:5]}")
            f = handles.get(files[key]) or handles.setdefault(files[key], SafetensorsFile(files[key]))
            if tuple(f.shape(key)) != tuple(tensor.shape):
                raise ValueError(f"{path}: {key} has shape {f.shape(key)}, the model expects {tuple(tensor.shape)}")
            placements = getattr(tensor, "placements", ())
            block = _read_block(f, key, block_ranges(tuple(tensor.shape), placements, pmodel.grid))
            local = tensor.to_local() if placements else tensor
            with torch.no_grad():
                local.copy_(block)
            bar.update(1)
    finally:
        bar.close()
        for f in handles.values():
            f.close()
    pmodel._materialized = True


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
                    progress: bool = True, **options):
    """Build a transformers model from `path`/config.json on the meta device, parallelize it, and read
    each rank's blocks from the safetensors weights in `path`. No rank materializes the whole model."""
    import transformers

    from autopar.api import parallelize

    config = transformers.AutoConfig.from_pretrained(path)
    if model_class is None:
        archs = getattr(config, "architectures", None) or []
        if not archs or not hasattr(transformers, archs[0]):
            raise ValueError(f"{path}/config.json names no transformers architecture ({archs}); "
                             f"pass model_class=, e.g. transformers.LlamaForCausalLM")
        model_class = getattr(transformers, archs[0])
    with meta_init():
        model = model_class(config)
    restore_buffers(model)
    pm = parallelize(model, grid=grid, example_inputs=example_inputs, example_kwargs=example_kwargs, **options)
    load_safetensors(pm, path, progress=progress)
    return pm


def save_pretrained(pmodel, path: str, max_shard_bytes: int = 2 * 2**30) -> None:
    """Write `pmodel` in HF format (config.json + safetensors); call on every rank. Each parameter is
    gathered on its own (all ranks take part), and rank 0 holds at most one shard's tensors at a time."""
    rank0 = pmodel.grid.rank == 0
    params = dict(pmodel.named_parameters())
    buffers = {n: b for n, b in pmodel.named_buffers() if n in pmodel._persistent_buffers}
    names = list(params) + list(buffers)
    sizes = {n: (params.get(n) if n in params else buffers[n]).numel() *
             (params.get(n) if n in params else buffers[n]).element_size() for n in names}
    shards, cur, cur_bytes = [], [], 0
    for n in names:
        if cur and cur_bytes + sizes[n] > max_shard_bytes:
            shards.append(cur)
            cur, cur_bytes = [], 0
        cur.append(n)
        cur_bytes += sizes[n]
    if cur:
        shards.append(cur)
    tmp = f"{path.rstrip('/')}.tmp-autopar"
    if rank0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = SINGLE if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for n in shard:
            t = params[n] if n in params else buffers[n]
            full = t.full_tensor() if hasattr(t, "full_tensor") else t  # collective: every rank calls it
            if rank0:
                tensors[n] = full.detach().cpu().contiguous()
            del full
        if rank0:
            write(os.path.join(tmp, fname), tensors, {"format": "pt"})
            weight_map.update({n: fname for n in shard})
        del tensors
    if rank0:
        if len(shards) > 1:
            total = sum(sizes.values())
            with open(os.path.join(tmp, INDEX), "w") as fh:
                json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, fh, indent=2)
        config = getattr(pmodel._source, "config", None)
        if config is not None:
            config.save_pretrained(tmp)
        _replace_dir(tmp, path)
    if dist.is_initialized():
        dist.barrier()


def _exchange(a: str, b: str) -> bool:
    """Atomically swap two directory entries (Linux renameat2 RENAME_EXCHANGE); False if unavailable."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def _replace_dir(new: str, path: str) -> None:
    """Put the complete directory `new` at `path`. With an existing `path` the two are swapped in one
    atomic step where the OS allows (a reader sees the old or the new checkpoint, never neither);
    elsewhere the old one is moved aside first and, if the process dies in between, is left at
    `path.old-autopar-<time>`."""
    if not os.path.exists(path):
        os.replace(new, path)
        return
    if _exchange(new, path):
        shutil.rmtree(new, ignore_errors=True)  # now holds the old checkpoint
        return
    old = f"{path.rstrip('/')}.old-autopar-{int(time.time())}"
    os.replace(path, old)
    os.replace(new, path)
    shutil.rmtree(old, ignore_errors=True)
