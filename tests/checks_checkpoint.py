"""Rank-side checks for checkpoint safety: saving next to other files, failures seen by rank 0 alone,
a rank that never arrives, and distributed checkpoints that survive an interrupted save. Each returns
plain data (or writes it to a file, for the freshly spawned process groups) for the test to assert on."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import time

import torch
import torch.distributed as dist

import autopar
from autopar.checkpoint import hf as checkpoint
from tests.checks_robust import _err
from tests.checks_hf import build
from tests.compare import excess

GOOD_SHARD = 20_000  # bytes: the test GPT-2 splits into several shards


def _gpt2(seed=0, grid=(2, 2), **options):
    torch.manual_seed(seed)
    model, make = build("gpt2")
    model.eval()
    if "timeout" in options:  # groups made with a short timeout must also connect within it: start together
        dist.barrier()
    pm = autopar.parallelize(model, grid=grid, example_kwargs=make(4, 8, 0), **options)
    pm.eval()
    return model, pm


def _exact(pm, want: dict) -> dict:
    """{name: excess} of every parameter against `want` with zero tolerance (a save is bit-exact)."""
    return {n: excess(p.full_tensor(), want[n], rtol=0.0, atol=0.0) for n, p in pm.named_parameters()}


def _digests(path: str) -> dict:
    return {f: hashlib.sha256(open(os.path.join(path, f), "rb").read()).hexdigest()
            for f in sorted(os.listdir(path)) if os.path.isfile(os.path.join(path, f))}


def _on_rank0(setup):
    if dist.get_rank() == 0:
        setup()
    dist.barrier()


def keeps_other_files(rank, tmp):
    """Sharded, then single-file, then sharded with another shard count into one directory that holds
    a tokenizer, a README and names close to ours; then from_pretrained without model_class=."""
    model, pm = _gpt2()
    path = os.path.join(tmp, "mixed")
    others = ["tokenizer.json", "README.md", "model-notes.txt", "model-00001-of-00002.safetensors.bak",
              "notes.tmp-autopar"]

    def setup():
        os.makedirs(path)
        for name in others + ["model.safetensors.tmp-autopar"]:  # the last: left by a killed save
            with open(os.path.join(path, name), "w") as f:
                f.write(name)
    _on_rank0(setup)
    listings, indexed = [], []  # the directory, and the files its index names, after each save
    for max_bytes in (GOOD_SHARD, 2**40, 40_000):
        autopar.save_pretrained(pm, path, max_shard_bytes=max_bytes)
        listings.append(sorted(os.listdir(path)))
        index = os.path.join(path, "model.safetensors.index.json")
        indexed.append(sorted(set(json.load(open(index))["weight_map"].values())) if os.path.exists(index) else [])
    config = open(os.path.join(path, "config.json")).read()
    back = autopar.from_pretrained(path, grid=(2, 2), example_kwargs=build("gpt2")[1](4, 8, 0), progress=False)
    return {"listings": listings, "indexed": indexed, "others": {n: open(os.path.join(path, n)).read() for n in others},
            "config": config, "errs": _exact(back, dict(model.named_parameters()))}


def rank0_failures(rank, tmp):
    """Failures that only rank 0 can see: each must raise the same error on every rank (none hangs)
    and leave the previous checkpoint's files as they were, with no temporary file behind."""
    _, pm = _gpt2()
    out = {}
    target = os.path.join(tmp, "a_file")
    _on_rank0(lambda: open(target, "w").close())
    out["file target"] = _err(lambda: autopar.save_pretrained(pm, target))
    dangling = os.path.join(tmp, "dangling")
    _on_rank0(lambda: os.symlink(os.path.join(tmp, "nowhere"), dangling))
    out["dangling symlink"] = _err(lambda: autopar.save_pretrained(pm, dangling))
    out["not writable"] = _patched(rank, os, "access", lambda *a, **k: False,
                                   lambda: autopar.save_pretrained(pm, os.path.join(tmp, "ro")))

    good = os.path.join(tmp, "good")
    autopar.save_pretrained(pm, good, max_shard_bytes=GOOD_SHARD)
    before = _digests(good)
    out["disk full"] = _patched(rank, checkpoint, "write", _full_on_second_call(checkpoint.write),
                                lambda: autopar.save_pretrained(pm, good, max_shard_bytes=GOOD_SHARD))
    out["disk full: files"] = _digests(good) == before
    out["permission at finish"] = _patched(rank, os, "replace", _denied,
                                           lambda: autopar.save_pretrained(pm, good, max_shard_bytes=GOOD_SHARD))
    out["permission: files"] = _digests(good) == before

    real = os.path.join(tmp, "real_dir")
    link = os.path.join(tmp, "link_to_dir")
    _on_rank0(lambda: (os.makedirs(real), os.symlink(real, link)))
    autopar.save_pretrained(pm, link)
    out["through symlink"] = sorted(os.listdir(real))
    here = os.getcwd()
    dot = os.path.join(tmp, "dot")
    _on_rank0(lambda: os.makedirs(dot))
    os.chdir(dot)
    try:
        autopar.save_pretrained(pm, ".")
    finally:
        os.chdir(here)
    out["dot"] = sorted(os.listdir(dot))
    return out


def _patched(rank, owner, attr, fake, fn):
    """fn() with owner.attr replaced by `fake` on rank 0 only."""
    real = getattr(owner, attr)
    if rank == 0:
        setattr(owner, attr, fake)
    try:
        return _err(fn)
    finally:
        setattr(owner, attr, real)


def _full_on_second_call(real_write):
    calls = []

    def write(path, *args, **kwargs):
        calls.append(path)
        if len(calls) == 2:
            with open(path, "wb") as f:  # a partial file, as a full disk leaves it
                f.write(b"\0" * 100)
            raise OSError(errno.ENOSPC, "No space left on device", path)
        real_write(path, *args, **kwargs)
    return write


def _denied(src, dst):
    raise PermissionError(errno.EACCES, "Permission denied", dst)


def skipping_rank(rank, world, port, outdir):
    """Fresh group with timeout=5: rank 3 never calls save_pretrained (but stays alive); the others
    must raise a CollectiveError soon after the timeout, not wait for the process group's default."""
    from autopar.launch import init_local

    init_local(rank, world, port)
    _, pm = _gpt2(timeout=5)
    if rank == 3:
        time.sleep(30)
        os._exit(0)
    start = time.time()
    kind, msg = _err(lambda: autopar.save_pretrained(pm, os.path.join(outdir, "ckpt")))
    with open(os.path.join(outdir, f"rank{rank}.txt"), "w") as f:
        f.write(f"{kind}\n{time.time() - start:.2f}\n{msg}")
    os._exit(0)


def _train(pm, opt, steps) -> None:
    """One AdamW step per GPT-2 batch of `steps`."""
    make = build("gpt2")[1]
    for step in steps:
        pm(**make(4, 8, step)).loss.backward()
        opt.step()
        opt.zero_grad()


def dcp_roundtrip(rank, tmp):
    """save_distributed twice into one path (the second swaps out the first), then load_distributed
    into a fresh model and optimizer at another grid shape: every parameter and Adam state equal."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    _, pm = _gpt2()
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    path = os.path.join(tmp, "dcp")
    _train(pm, opt, range(1))
    checkpoint.save_distributed(pm, path, optimizer=opt)
    _train(pm, opt, range(1, 2))
    checkpoint.save_distributed(pm, path, optimizer=opt)
    want = {n: p.full_tensor() for n, p in pm.named_parameters()}
    want_opt = get_optimizer_state_dict(pm, opt)["state"]
    _, pm2 = _gpt2(seed=1, grid=(1, 4), strategy="1d")
    opt2 = torch.optim.AdamW(pm2.parameters(), lr=1e-2)
    _train(pm2, opt2, range(1))  # creates Adam state, which the load must overwrite
    checkpoint.load_distributed(pm2, path, optimizer=opt2)
    got_opt = get_optimizer_state_dict(pm2, opt2)["state"]
    errs = _exact(pm2, want)
    for n, st in want_opt.items():
        for k in ("exp_avg", "exp_avg_sq"):
            errs[f"{n}.{k}"] = excess(got_opt[n][k].full_tensor(), st[k].full_tensor(), rtol=0.0, atol=0.0)
    missing = _err(lambda: checkpoint.load_distributed(pm2, os.path.join(tmp, "nothing_here")))
    return {"errs": errs, "files": sorted(os.listdir(tmp)), "missing": missing}


def dcp_interrupted(rank, world, port, outdir, mode):
    """Fresh group: a good save_distributed, then a second save that fails mid-write on one rank
    (mode 'kill': rank 2 dies; 'raise': rank 1's writer raises). The survivors must raise, and the
    first checkpoint must still be at `path`, whole."""
    from torch.distributed.checkpoint import filesystem

    from autopar.launch import init_local

    init_local(rank, world, port)
    _, pm = _gpt2(timeout=10)
    path = os.path.join(outdir, "ckpt")
    checkpoint.save_distributed(pm, path)
    full = {n: p.full_tensor() for n, p in pm.named_parameters()}
    if rank == 0:
        torch.save(full, os.path.join(outdir, "expected.pt"))
    with torch.no_grad():
        for p in pm.parameters():
            p.to_local().add_(1.0)  # a different model, whose save fails
    real = filesystem.FileSystemWriter.write_data

    def failing(self, *args, **kwargs):
        if mode == "kill" and rank == 2:
            os._exit(9)
        if mode == "raise" and rank == 1:
            raise RuntimeError("injected write failure")
        return real(self, *args, **kwargs)

    filesystem.FileSystemWriter.write_data = failing
    try:
        kind, msg = _err(lambda: checkpoint.save_distributed(pm, path))
    except BaseException as e:  # DCP's CheckpointException derives from BaseException
        kind, msg = type(e).__name__, str(e)
    with open(os.path.join(outdir, f"rank{rank}.txt"), "w") as f:
        f.write(f"{kind}\n{msg}")
    os._exit(0)
