"""Saving HF-format checkpoints without any rank holding the whole model: parameters gathered one at
a time, written by rank 0 into safetensors shards of at most `max_shard_bytes` under the keys
transformers writes, with config.json. Only the files it writes are replaced (each atomically, after
every shard is complete), so other files in `path` survive and an interrupted save leaves the
previous checkpoint loadable. Every rank agrees on each step's outcome, so a failure on rank 0 alone
raises on all ranks instead of leaving them waiting in a gather. `save_pretrained`
(`autopar.checkpoint.pretrained`) chooses what to write; `save_view` writes it."""

from __future__ import annotations

import json
import math
import os

import torch
import torch.distributed as dist

from autopar.checkpoint import files as F
from autopar.checkpoint import keys as hf_keys
from autopar.checkpoint.safetensors_io import write
from autopar.program.consensus import AXES, agree, on_rank0
from passes.ops.comm import guarded

INDEX = F.INDEX

__all__ = ["Remote", "own_tensors", "pipeline_tensors", "save_view"]


def own_tensors(pmodel) -> dict:
    """(name -> tensor of every saved parameter and persistent buffer): a transformers model the names
    its own save_pretrained saves; another model every name its state_dict has (a tied one included:
    its load_state_dict is strict)."""
    source = pmodel.source_model
    own = dict(pmodel.named_parameters())
    own.update((n, b) for n, b in pmodel.named_buffers() if n in pmodel.persistent_buffer_names)
    if hf_keys.is_transformers_model(source):
        aliases = hf_keys.aliases(pmodel)
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
                        if isinstance(t, Remote):  # another pipeline rank's: rank 0 receives it whole
                            whole = t.receive() if grid.rank == 0 else None
                        else:
                            whole = t.full_tensor() if hasattr(t, "full_tensor") else t  # every rank calls it
                            _send_to_rank0(grid, whole)
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


class Remote:
    """A tensor another pipeline rank holds (`pipeline_tensors`): gathered there over its grid and sent
    whole to rank 0 by that rank's first process."""

    def __init__(self, owner: int, shape: tuple, dtype, device):
        self.owner, self.shape, self.dtype, self.device = owner, shape, dtype, device
        self.numel_ = math.prod(shape)

    def numel(self) -> int:
        return self.numel_

    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def receive(self):
        out = torch.empty(self.shape, dtype=self.dtype, device=self.device)  # the grid's device (NCCL: the GPU)
        dist.recv(out, src=self.owner)
        return out


def _send_to_rank0(grid, whole) -> None:
    """A pipeline stage's first process sends what its grid gathered to rank 0 (which writes)."""
    stage = getattr(grid, "stage", 0)
    if stage and grid.rank == stage * grid.dp * grid.world:
        dist.send(whole.detach().contiguous(), dst=0)  # where the grid gathered it (NCCL: the GPU)


def pipeline_tensors(pmodel) -> dict:
    """`own_tensors` of a pipelined model: each name's tensor where this rank holds it, else a `Remote`
    naming the pipeline rank that does (the first holding any of its names)."""
    grid, source = pmodel.grid, pmodel.source_model
    mine = dict(pmodel.named_parameters())
    mine.update(pmodel.named_buffers())
    held: list = [None] * grid.stages
    dist.all_gather_object(held, sorted(mine), group=grid.pp_group)
    full = dict(source.named_parameters(remove_duplicate=False))
    full.update(source.named_buffers())
    if hf_keys.is_transformers_model(source):
        names = hf_keys.save_names(source)
    else:
        names = list(source.state_dict(keep_vars=True))
    groups = hf_keys.aliases(pmodel)
    out = {}
    for n in names:
        holders = [(p, a) for p, have in enumerate(held) for a in groups.get(n, [n]) if a in have]
        if not holders:
            continue  # a buffer no stage keeps (not persistent)
        p, found = holders[0]
        if p == grid.stage:
            out[n] = mine[found]
        else:
            t = full[n]
            out[n] = Remote(p * grid.dp * grid.world, tuple(t.shape), t.dtype, grid.device)
    return out


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
