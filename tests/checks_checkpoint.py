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
from autopar.checkpoint import save as saving
from tests.checks_robust import _err
from tests.checks_hf import build
from tests.compare import excess, group_excess

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
        dist.barrier()  # rank 0's next save takes its lock (a file in `path`) at once: list before it
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
    dist.barrier()  # each rank reads the directory before rank 0's next save takes its lock there
    out["disk full"] = _patched(rank, saving, "write", _full_on_second_call(saving.write),
                                lambda: autopar.save_pretrained(pm, good, max_shard_bytes=GOOD_SHARD))
    out["disk full: files"] = _digests(good) == before
    dist.barrier()
    out["permission at finish"] = _patched(rank, os, "replace", _denied,
                                           lambda: autopar.save_pretrained(pm, good, max_shard_bytes=GOOD_SHARD))
    out["permission: files"] = _digests(good) == before
    dist.barrier()

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


def load_refusals(rank, tmp):
    """Checkpoints a load must refuse with the file's name, never block on, never load as wrong values:
    a FIFO, a directory or a symlink to /proc/self/mem where a shard should be, an index placing a key
    in a shard that lacks it, an F32 tensor relabelled I32 (same byte size), a valid I32 tensor for a
    float parameter. Then the good checkpoint loads bit-exactly."""
    import shutil

    model, pm = _gpt2()
    good = os.path.join(tmp, "good")
    autopar.save_pretrained(pm, good, max_shard_bytes=GOOD_SHARD)
    shard = "model-00001-of-%05d.safetensors" % len([f for f in os.listdir(good) if f.endswith(".safetensors")])
    index = json.load(open(os.path.join(good, "model.safetensors.index.json")))["weight_map"]
    first, second = sorted(set(index.values()))[:2]
    assert first == shard, (first, shard)
    key = next(k for k, f in index.items() if f == first)

    def variant(name, change):
        path = os.path.join(tmp, name)
        if rank == 0:
            shutil.copytree(good, path)
            change(path)
        dist.barrier()
        return path

    def relabel(path, file, dtype):  # the first F32 entry's dtype rewritten in place: same header length
        raw = open(os.path.join(path, file), "rb").read()
        n = int.from_bytes(raw[:8], "little")
        at = raw.index(b'"F32"', 8, 8 + n)
        with open(os.path.join(path, file), "wb") as f:
            f.write(raw[:at] + f'"{dtype}"'.encode() + raw[at + 5:])

    def replace(path, fn):
        os.remove(os.path.join(path, first))
        fn(os.path.join(path, first))

    def wrong_index(path):
        moved = dict(index, **{key: second})
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": moved}, f)

    def ints(path):
        relabel(path, first, "I32")

    def valid_int(path):  # a whole shard rewritten with one float tensor stored as int32 values
        from autopar.checkpoint.safetensors_io import SafetensorsFile, write
        f = SafetensorsFile(os.path.join(path, first))
        tensors = {k: f.read(k, [(0, n) for n in f.shape(k)]) for k in f.keys()}
        f.close()
        tensors[key] = tensors[key].to(torch.int32)
        write(os.path.join(path, first), tensors, {"format": "pt"})

    cases = {"fifo": lambda p: replace(p, os.mkfifo), "directory": lambda p: replace(p, os.mkdir),
             "proc mem": lambda p: replace(p, lambda d: os.symlink("/proc/self/mem", d)),
             "key in another shard": wrong_index, "relabelled I32": ints, "valid I32": valid_int}
    out = {}
    for name, change in cases.items():
        path = variant(name.replace(" ", "_"), change)
        out[name] = _err(lambda p=path: autopar.load_safetensors(pm, p, progress=False))
    out["key"], out["first"] = key, first
    autopar.load_safetensors(pm, good, progress=False)
    out["good after"] = _exact(pm, dict(model.named_parameters()))
    return out


def save_refusals(rank, tmp):
    """save_distributed through a symlink to a directory (twice: the second replaces the first), saves
    into places whose lock another process holds (the test's), and a load of a DCP checkpoint missing
    a data file: the error, caught by `except Exception`."""
    import glob

    _, pm = _gpt2()
    want = {n: p.full_tensor() for n, p in pm.named_parameters()}
    real, link = os.path.join(tmp, "real_dcp"), os.path.join(tmp, "link_dcp")
    _on_rank0(lambda: (os.makedirs(real), os.symlink(real, link)))
    out = {"symlink saves": [_err(lambda: checkpoint.save_distributed(pm, link)) for _ in range(2)]}
    out["link still a link"] = os.path.islink(link) and os.path.realpath(link) == os.path.realpath(real)
    out["real holds"] = sorted(os.listdir(real))[:1]
    out["siblings"] = sorted(n for n in os.listdir(tmp) if n.startswith(("real_dcp", "link_dcp")))
    _, pm2 = _gpt2(seed=3)
    checkpoint.load_distributed(pm2, link)
    out["load through link"] = _exact(pm2, want)
    out["held dcp"] = _err(lambda: checkpoint.save_distributed(pm, os.path.join(tmp, "held")))
    out["held hf"] = _err(lambda: autopar.save_pretrained(pm, os.path.join(tmp, "held_hf")))
    out["held dirs"] = sorted(os.listdir(os.path.join(tmp, "held_hf")))
    broken = os.path.join(tmp, "broken")
    checkpoint.save_distributed(pm, broken)
    _on_rank0(lambda: os.remove(sorted(glob.glob(os.path.join(broken, "*.distcp")))[0]))
    try:
        checkpoint.load_distributed(pm2, broken)
        out["broken"] = (None, "")
    except Exception as e:  # the point: a training loop's `except Exception` catches it
        out["broken"] = (type(e).__name__, str(e))
    return out


def _five_second_group(rank, world, port):
    """A fresh group made with init_process_group(timeout=5 s); GPT-2 parallelized at 2x2 without
    timeout=, called once on every rank: (pmodel, batch)."""
    import datetime

    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=5))
    model, make = build("gpt2")
    batch = make(4, 8, 0)
    pm = autopar.parallelize(model, grid=(2, 2), example_kwargs=batch)
    pm(**batch)  # every rank in step once
    return pm, batch


def slow_rank_group_timeout(rank, world, port, outdir):
    """Fresh group made with init_process_group(timeout=5 s), parallelize without timeout=: rank 3
    sleeps through a forward; the others must give up after the group's 5 s, not torch's 30 min."""
    pm, batch = _five_second_group(rank, world, port)
    if rank == 3:
        time.sleep(30)
        os._exit(0)
    start = time.time()
    kind, msg = _err(lambda: pm(**batch))
    with open(os.path.join(outdir, f"rank{rank}.txt"), "w") as f:
        f.write(f"{kind}\n{time.time() - start:.2f}\n{pm.grid.timeout}\n{msg}")
    os._exit(0)


def retry_after_a_failure(rank, world, port, outdir):
    """Fresh group made with init_process_group(timeout=5 s), parallelize without timeout=."""
    pm, batch = _five_second_group(rank, world, port)
    # rank 1 fails mid-forward (a hook on a kernel half way raises once), catches it and calls again, as a
    # training loop retrying a step would; every rank retries once. All must end within the group's
    # timeout (raise or return), none blocks for good
    kernels = [m for n, m in pm.graph_module.named_children() if n.startswith("autopar_")]
    middle = kernels[len(kernels) // 2]  # a kernel half way through the program, after some collectives
    fired = []

    def fail_once(module, args):
        if rank == 1 and not fired:
            fired.append(1)
            raise RuntimeError("a failure inside the forward (injected)")
    hook = middle.register_forward_pre_hook(fail_once)
    start = time.time()
    retry = []
    for _ in range(2):
        retry.append(_err(lambda: pm(**batch))[0])
    retry_s = time.time() - start
    hook.remove()
    with open(os.path.join(outdir, f"rank{rank}.txt"), "w") as f:
        f.write(" ".join(str(k) for k in retry) + f"\n{retry_s:.2f}")
    os._exit(0)


def switch_keeps_one_checkpoint(rank, tmp):
    """Into a directory holding user files named like shards (model-00001-of-0000k.safetensors, k = 2..9,
    which no index lists), two sharded saves of different weights and shard counts, then a save that
    dies at the switch (renaming the new index into place fails on rank 0). The user's files stay
    byte for byte, and after the failed save the directory loads the second save exactly."""
    model, pm = _gpt2()
    path = os.path.join(tmp, "switch")
    users = [f"model-00001-of-{k:05d}.safetensors" for k in range(2, 10)]
    _on_rank0(lambda: (os.makedirs(path), [open(os.path.join(path, u), "w").write(f"user file {u}") for u in users]))
    out = {"saves": []}
    for max_bytes in (GOOD_SHARD, 2 * GOOD_SHARD):
        with torch.no_grad():
            for p in pm.parameters():
                p.add_(0.01)
        autopar.save_pretrained(pm, path, max_shard_bytes=max_bytes)
        index = json.load(open(os.path.join(path, "model.safetensors.index.json")))["weight_map"]
        out["saves"].append(sorted(set(index.values())))
    want = {n: p.full_tensor() for n, p in pm.named_parameters()}
    before = _digests(path)
    dist.barrier()  # every rank has read the directory before rank 0's next save locks it
    real = os.replace

    def dies_at_switch(src, dst):  # renaming the new index into place: where a kill would hit
        if os.path.basename(dst) == "model.safetensors.index.json":
            raise OSError(errno.EIO, "Input/output error (the process dies here)", dst)
        real(src, dst)
    with torch.no_grad():
        for p in pm.parameters():
            p.add_(0.01)
    out["failed save"] = _patched(rank, os, "replace", dies_at_switch,
                                  lambda: autopar.save_pretrained(pm, path, max_shard_bytes=3 * GOOD_SHARD))
    out["files unchanged"] = _digests(path) == before
    dist.barrier()
    out["users"] = {u: open(os.path.join(path, u)).read() for u in users}
    out["listing"] = sorted(os.listdir(path))
    back = autopar.from_pretrained(path, grid=(2, 2), example_kwargs=build("gpt2")[1](4, 8, 0), progress=False)
    out["errs"] = _exact(back, want)
    return out


def plain_module_roundtrip(rank, path):
    """A plain nn.Module (TinyGPT, its head tied to the embedding) after one AdamW step at 2x2: saved with
    autopar.save_pretrained, read back with autopar.load_full_state_dict by the unmodified model's
    strict load_state_dict (on every rank, no process group used), bit-equal to the parallel model's
    full tensors; and torch.save(pm.state_dict()) warns naming those calls, where a deepcopy does not."""
    import copy
    import io
    import warnings

    from examples.models import GPTConfig, TinyGPT
    from tests.checks_engine import _data

    torch.manual_seed(0)
    cfg = GPTConfig(layers=1)
    pm = autopar.parallelize(TinyGPT(cfg), grid=(2, 2), example_inputs=_data(cfg, 4, 8))
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    pm(*_data(cfg, 4, 8))[1].backward()
    opt.step()
    full = {n: t.full_tensor() if hasattr(t, "full_tensor") else t for n, t in pm.state_dict().items()}
    autopar.save_pretrained(pm, path)
    dist.barrier()
    torch.manual_seed(5)
    fresh = TinyGPT(cfg)  # other weights: everything must come from the file
    loaded = autopar.load_full_state_dict(path)
    result = fresh.load_state_dict(loaded)  # strict
    errs = {n: excess(t, full[n.replace("head.weight", "tok.weight")] if n not in full else full[n], 0.0, 0.0)
            for n, t in fresh.state_dict().items()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.save(pm.state_dict(), io.BytesIO())
        said = [str(w.message) for w in caught if issubclass(w.category, autopar.CheckpointWarning)]
        copy.deepcopy(pm.state_dict())
        after_copy = [str(w.message) for w in caught if issubclass(w.category, autopar.CheckpointWarning)]
    return {"errs": errs, "missing": list(result.missing_keys), "unexpected": list(result.unexpected_keys),
            "keys": sorted(loaded), "model keys": sorted(fresh.state_dict()), "said": said,
            "warnings after deepcopy": len(after_copy),
            "tied shares": fresh.head.weight is fresh.tok.weight}


def peft_roundtrip(rank, path):
    """peft LoRA on q_proj and v_proj of the test Llama, one SGD step at 2x2 and on one process (only the
    adapter trains). Both ways, against peft and transformers on one process (no process group used to
    load): autopar's save read by peft (base + adapter) and by transformers (merged=True); peft's own
    adapter and transformers' base checkpoint read by autopar.from_pretrained(base, adapter=...). Returns
    the excess of each output and loss against the one-process peft model's."""
    import copy

    import peft
    import transformers as T

    torch.manual_seed(0)
    model, make = build("llama")
    base_dir, peft_dir = os.path.join(path, "base-by-transformers"), os.path.join(path, "adapter-by-peft")
    if rank == 0:
        model.save_pretrained(base_dir)  # the base as a user has it, before the adapter
    ref = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    batch = make(4, 8, 0)
    pm = autopar.parallelize(copy.deepcopy(ref), grid=(2, 2), example_kwargs=batch)
    for m in (ref, pm):  # one step: lora_B leaves zero, the update is the adapter's only
        opt = torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.5)
        m(**batch).loss.backward()
        opt.step()
    ref.eval()
    pm.eval()
    batch = make(4, 8, 1)
    want = ref(**batch)
    errs = group_excess({"parallel loss": (pm(**batch).loss, want.loss)})
    ours = os.path.join(path, "by-autopar")
    pm.save_pretrained(ours)  # as a peft user calls it
    autopar.save_pretrained(pm, os.path.join(path, "merged"), merged=True)
    if rank == 0:
        ref.save_pretrained(peft_dir)
    dist.barrier()
    base = T.AutoModelForCausalLM.from_pretrained(os.path.join(ours, "base"))
    read = peft.PeftModel.from_pretrained(base, ours).eval()
    errs.update(group_excess({"peft reads autopar's save": (read(**batch).logits, want.logits)}))
    merged = T.AutoModelForCausalLM.from_pretrained(os.path.join(path, "merged")).eval()
    errs.update(group_excess({"transformers reads the merged save": (merged(**batch).logits, want.logits)}))
    back = autopar.from_pretrained(base_dir, grid=(2, 2), adapter=peft_dir, example_kwargs=batch, progress=False)
    back.eval()
    out = back(**batch)
    errs.update(group_excess({"autopar reads peft's adapter: logits": (out.logits.full_tensor(), want.logits)}))
    errs.update(group_excess({"autopar reads peft's adapter: loss": (out.loss, want.loss)}))
    lora = [n for n, p in back.named_parameters() if p.requires_grad]
    files = sorted(os.listdir(ours))
    return {"errs": errs, "files": files, "trainable": lora,
            "adapter keys": sorted(safetensors_keys(os.path.join(ours, "adapter_model.safetensors"))),
            "peft keys": sorted(safetensors_keys(os.path.join(peft_dir, "adapter_model.safetensors")))}


def safetensors_keys(file):
    from safetensors import safe_open

    with safe_open(file, "pt") as f:
        return list(f.keys())
