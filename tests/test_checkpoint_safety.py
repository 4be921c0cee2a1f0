"""Checkpoint safety: a save leaves other files alone and fails on every rank at once, the reader
refuses forged safetensors files and indexes, a stuck rank makes the others raise after the timeout,
and a distributed checkpoint survives an interrupted save."""

import functools
import json
import os
import struct
import tracemalloc

import pytest
import safetensors
import safetensors.torch
import torch

from autopar.checkpoint.hf import checkpoint_files
from autopar.checkpoint.safetensors_io import SafetensorsFile, write
from tests.dist_pool import spawn_fresh
from tests import checks_checkpoint as C
from tests.compare import excess, failures


def _spawn(fn, world, tmp_path):
    return spawn_fresh(fn, world, str(tmp_path))


def _forge(path, header, data=b"", length=None):
    raw = json.dumps(header).encode() if not isinstance(header, bytes) else header
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw) if length is None else length) + raw + data)
    return str(path)


def _two_tensors():
    """A valid header for a = F32[2, 2], b = F32[3] and its 28 data bytes."""
    header = {"a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
              "b": {"dtype": "F32", "shape": [3], "data_offsets": [16, 28]}}
    return header, torch.arange(7, dtype=torch.float32).numpy().tobytes()


def _with(entry, **fields):
    header, data = _two_tensors()
    header[entry] = {**header[entry], **fields}
    return header, data


FORGED = {  # name -> (header, data, words the refusal must contain)
    "points into another tensor": (*_with("b", data_offsets=[12, 24]), "tensor 'b': data_offsets [12, 24] overlaps"),
    "relabelled dtype": (*_with("a", dtype="F16"),
                         "tensor 'a': data_offsets [0, 16] span 16 bytes, but F16 [2, 2] needs 8"),
    "unknown dtype": (*_with("a", dtype="F128"), "tensor 'a': dtype 'F128' is not one of"),
    "negative shape": (*_with("b", shape=[-3]), "tensor 'b': shape [-3] must be a list of non-negative ints"),
    "float shape": (*_with("b", shape=[3.0]), "tensor 'b': shape [3.0] must be a list of non-negative ints"),
    "offsets past the end": (*_with("b", data_offsets=[16, 40], shape=[6]),
                             "the tensors cover 40 bytes of data, the file holds 28"),
    "gap": (*_with("b", data_offsets=[20, 32]), "leaves a gap after the tensor before it"),
    "reversed offsets": (*_with("b", data_offsets=[28, 16]), "must be [begin, end] with 0 <= begin <= end"),
    "header is a list": ([1, 2], b"", "header is a JSON list, expected an object"),
    "header not JSON": (b"{not json", b"", "header is not UTF-8 JSON"),
    "metadata not strings": ({**_two_tensors()[0], "__metadata__": {"k": 1}}, _two_tensors()[1],
                             "__metadata__ must map strings to strings"),
    "entry without offsets": ({"a": {"dtype": "F32", "shape": [0]}}, b"",
                              "expected an object with dtype, shape and data_offsets"),
}


@pytest.mark.parametrize("case", sorted(FORGED))
def test_forged_safetensors_refused_like_the_library(tmp_path, case):
    """Catches a reader that trusts the header: a tensor reading another's bytes, a relabelled
    dtype reinterpreting them, offsets past the file. The safetensors library refuses the same file,
    so the rule is the format's, not a stricter one of ours."""
    header, data, words = FORGED[case]
    path = _forge(tmp_path / "x.safetensors", header, data)
    with pytest.raises(Exception):  # noqa: B017  the library's error type is its own; that it refuses is the point
        safetensors.safe_open(path, framework="pt")
    with pytest.raises(ValueError, match="not a valid safetensors file") as e:
        SafetensorsFile(path)
    assert path in str(e.value) and words in str(e.value), str(e.value)


def test_header_length_bomb_allocates_nothing(tmp_path):
    """Catches reading a 2 GiB header length as-is (2.8 GB allocated before failing)."""
    header, data = _two_tensors()
    path = _forge(tmp_path / "bomb.safetensors", header, data, length=2**31)
    tracemalloc.start()
    with pytest.raises(ValueError, match="header length 2147483648 bytes exceeds the 100000000-byte limit"):
        SafetensorsFile(path)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 2**20, peak
    path = _forge(tmp_path / "short.safetensors", header, data, length=10_000)
    with pytest.raises(ValueError, match="header length 10000 bytes runs past the end of the"):
        SafetensorsFile(path)
    path = _forge(tmp_path / "tiny.safetensors", b"", length=0)
    with open(path, "wb") as f:
        f.write(b"\1\2")
    with pytest.raises(ValueError, match="fewer than the 8-byte header length"):
        SafetensorsFile(path)


def test_library_files_read_exactly(tmp_path):
    """Catches validation stricter than the format: files the safetensors library writes (several
    dtypes, an empty tensor, metadata) pass and every block reads back bit-exactly, ours as well."""
    torch.manual_seed(0)
    tensors = {"w": torch.randn(6, 4), "h": torch.randn(3, 5).to(torch.bfloat16), "i": torch.arange(10),
               "u": torch.randint(0, 255, (7,), dtype=torch.uint8), "empty": torch.zeros(0, 3),
               "mask": torch.rand(4) > 0.5}
    safetensors.torch.save_file(tensors, str(tmp_path / "lib.safetensors"), metadata={"format": "pt"})
    write(str(tmp_path / "ours.safetensors"), tensors, {"format": "pt"})
    for path in (tmp_path / "lib.safetensors", tmp_path / "ours.safetensors"):
        f = SafetensorsFile(str(path))
        for name, t in tensors.items():
            whole = f.read(name, [(0, n) for n in t.shape])
            assert whole.dtype == t.dtype and torch.equal(whole, t), name
        assert torch.equal(f.read("w", [(2, 4), (1, 3)]), tensors["w"][2:4, 1:3])
        f.close()


def _index(tmp_path, weight_map):
    write(str(tmp_path / "model-00001-of-00001.safetensors"), {"a": torch.ones(2)})
    with open(tmp_path / "model.safetensors.index.json", "w") as f:
        json.dump({"weight_map": weight_map}, f)
    return str(tmp_path)


@pytest.mark.parametrize("name", ["../x.safetensors", "/etc/passwd", "sub/../../x.safetensors", "linked/x.safetensors"])
def test_index_paths_stay_inside(tmp_path, name):
    """Catches an index that opens files outside the checkpoint: '..', an absolute path, or a
    subdirectory that is a symlink to elsewhere."""
    (tmp_path / "elsewhere").mkdir()
    write(str(tmp_path / "elsewhere" / "x.safetensors"), {"a": torch.ones(2)})
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    os.symlink(tmp_path / "elsewhere", ckpt / "linked")
    path = _index(ckpt, {"a": name})
    with pytest.raises(ValueError, match="points outside the checkpoint directory") as e:
        checkpoint_files(path)
    assert repr(name) in str(e.value) and "weight_map['a']" in str(e.value)


def test_index_file_symlink_followed_and_bad_index_refused(tmp_path):
    """A file symlink inside the directory (the Hugging Face hub cache layout) is read; an index
    that is not a JSON object with a weight_map is refused with its name, not a KeyError."""
    blob = tmp_path / "blob"
    write(str(blob), {"a": torch.ones(2)})
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    os.symlink(blob, ckpt / "model-00001-of-00001.safetensors")
    with open(ckpt / "model.safetensors.index.json", "w") as f:
        json.dump({"weight_map": {"a": "model-00001-of-00001.safetensors"}}, f)
    assert checkpoint_files(str(ckpt)) == {"a": str(ckpt / "model-00001-of-00001.safetensors")}
    for content, words in (("[1]", "not a JSON object with a 'weight_map'"),
                           ('{"weight_map": ["a"]}', "'weight_map' must map tensor names to file names")):
        (ckpt / "model.safetensors.index.json").write_text(content)
        with pytest.raises(ValueError, match=words):
            checkpoint_files(str(ckpt))


def test_save_keeps_other_files_and_removes_only_stale_weights(pool4, tmp_path):
    """Catches a save that swaps the whole directory (deleting a tokenizer / README), one that leaves
    the shards of a previous save of another count (or a single file beside an index), and a
    config.json without `architectures` (from_pretrained would need model_class=)."""
    r = pool4.run(C.keeps_other_files, str(tmp_path))
    others = ["README.md", "model-00001-of-00002.safetensors.bak", "model-notes.txt", "notes.tmp-autopar",
              "tokenizer.json"]
    for res in r:
        first, single, resharded = res["listings"]
        shards, none, reshards = res["indexed"]
        assert len(shards) > len(reshards) > 1 and none == [], res["indexed"]
        assert first == sorted(others + shards + ["config.json", "model.safetensors.index.json"]), first
        assert single == sorted(others + ["config.json", "model.safetensors"]), single
        assert resharded == sorted(others + reshards + ["config.json", "model.safetensors.index.json"]), resharded
        assert res["others"] == {n: n for n in others}
        assert json.loads(res["config"])["architectures"] == ["GPT2LMHeadModel"]
    assert failures([res["errs"] for res in r]) == {}


def test_rank0_failures_raise_on_every_rank(pool4, tmp_path):
    """Catches ranks 1-3 left waiting in a gather while rank 0 alone fails (a file as target, a
    dangling symlink, no write permission, a full disk, a failed rename), a failed save that
    changes the previous checkpoint or leaves temporary files; a symlink to a directory and '.' work."""
    r = pool4.run(C.rank0_failures, str(tmp_path), timeout=600)
    expect = {"file target": ("UsageError", "is a file, not a directory"),
              "dangling symlink": ("UsageError", "which does not exist: create that directory"),
              "not writable": ("CheckpointPermissionError", "is not writable by this process"),
              "disk full": ("CheckpointFileError", "writing shard 2 of "),
              "permission at finish": ("CheckpointPermissionError",
                                       "finishing failed on rank 0: [Errno 13] Permission denied")}
    for case, (kind, words) in expect.items():
        assert len({res[case] for res in r}) == 1, (case, [res[case] for res in r])  # the same error everywhere
        got_kind, msg = r[0][case]
        assert got_kind == kind and words in msg and "autopar.save_pretrained(" in msg, (case, r[0][case])
    for res in r:
        assert res["disk full: files"] and res["permission: files"], res
    good = sorted(os.listdir(tmp_path / "good"))
    assert not [f for f in good if "tmp-autopar" in f], good
    assert "model.safetensors" in r[0]["through symlink"] and "config.json" in r[0]["dot"]
    assert os.path.islink(tmp_path / "link_to_dir")


def test_skipped_save_raises_after_timeout(tmp_path):
    """Catches a save whose gathers wait for the process group's default timeout (30 min) when a
    rank never calls it: with parallelize(timeout=5) ranks 0-2 raise CollectiveError within 15 s."""
    hung = _spawn(C.skipping_rank, 4, tmp_path).join(ranks=range(3), timeout=120)  # rank 3 sleeps on purpose
    assert not hung, hung
    for rank in range(3):
        kind, elapsed, msg = (tmp_path / f"rank{rank}.txt").read_text().split("\n", 2)
        assert kind == "CollectiveError" and "A peer rank has probably exited" in msg, (rank, kind, msg)
        assert float(elapsed) < 15, (rank, elapsed)


def test_save_distributed_roundtrip(pool4, tmp_path):
    """Catches a swap that loses the checkpoint, a staging directory left behind, and a load that
    misses the optimizer: a 2x2 save loads at 1x4 with every parameter and Adam state bit-equal."""
    r = pool4.run(C.dcp_roundtrip, str(tmp_path))
    assert failures([res["errs"] for res in r]) == {}
    assert r[0]["files"] == ["dcp"], r[0]["files"]
    for res in r:
        kind, msg = res["missing"]
        assert kind == "CheckpointNotFoundError" and "nothing_here/.metadata not found" in msg, res["missing"]


@pytest.mark.parametrize("mode", ["kill", "raise"])
def test_interrupted_save_distributed_keeps_previous(tmp_path, mode):
    """Catches dcp.save into the live checkpoint directory: a save where one rank dies (or its
    writer raises) mid-way must leave the previous checkpoint whole and loadable, and no survivor hangs."""
    import torch.distributed.checkpoint as dcp

    hung = _spawn(functools.partial(C.dcp_interrupted, mode=mode), 4, tmp_path).join(timeout=150)
    assert not hung, f"a surviving rank hung: {hung}"
    survivors = [r for r in range(4) if not (mode == "kill" and r == 2)]
    for rank in survivors:  # a dead peer: bounded by timeout=10; a raising writer: DCP tells every rank
        kind, msg = (tmp_path / f"rank{rank}.txt").read_text().split("\n", 1)
        if mode == "kill":
            assert kind == "CollectiveError" and "torch.distributed.checkpoint.save" in msg, (rank, kind, msg)
        else:
            assert kind == "CheckpointFileError" and "injected write failure" in msg, (rank, kind, msg[:300])
    expected = torch.load(tmp_path / "expected.pt")
    state = {"model": {n: torch.empty_like(t) for n, t in expected.items()}}
    dcp.load(state, checkpoint_id=str(tmp_path / "ckpt"))
    assert failures([{n: excess(state["model"][n], t, rtol=0.0, atol=0.0) for n, t in expected.items()}]) == {}
    assert not (tmp_path / "ckpt.tmp-autopar" / ".metadata").exists()  # the failed save never finished


def test_target_and_block_refusals(tmp_path):
    """Catches a save target or staging path that fails later with an unclear OS error, a read
    outside a tensor, and an agreement that loses the error's kind (a PermissionError stays one, as
    autopar's CheckpointPermissionError) or its text."""
    from types import SimpleNamespace

    from autopar.checkpoint import files as files
    from autopar.errors import CheckpointFileError, CheckpointPermissionError
    from autopar.program.consensus import agree
    from autopar.checkpoint.dcp import prepare_staging

    with pytest.raises(ValueError, match="save path '' is empty"):
        files.check_target("")
    (tmp_path / "f").write_text("x")
    with pytest.raises(CheckpointFileError, match="cannot create the save directory .* check that its parent"):
        files.check_target(str(tmp_path / "f" / "sub"))
    with pytest.raises(ValueError, match="save_distributed path .* is a file, not a directory"):
        prepare_staging(str(tmp_path / "f"), str(tmp_path / "f.tmp-autopar"))
    write(str(tmp_path / "t.safetensors"), {"a": torch.ones(2, 3)})
    f = SafetensorsFile(str(tmp_path / "t.safetensors"))
    with pytest.raises(ValueError, match=r"block \[\(0, 3\), \(0, 3\)\] is not inside tensor 'a' of shape \[2, 3\]"):
        f.read("a", [(0, 3), (0, 3)])
    f.close()
    with pytest.raises(CheckpointPermissionError, match=r"^moving x failed on rank 0: denied$"):
        agree(SimpleNamespace(rank=0), PermissionError("denied"), "moving x")
    agree(SimpleNamespace(rank=0), None, "nothing failed")


def test_load_refuses_non_files_misplaced_keys_and_integer_weights(pool4, tmp_path):
    """A FIFO named like a shard blocked the load forever; a directory or a symlink to /proc/self/mem
    raised IsADirectoryError / OSError naming no file; an index placing a key in a shard without it
    raised a bare KeyError; an F32 tensor relabelled I32 loaded as garbage and a valid I32 tensor was
    cast into a float parameter. Each now raises on every rank naming the file and what was expected,
    and the good checkpoint still loads bit-exactly."""
    res = pool4.run(C.load_refusals, str(tmp_path))
    assert not failures([r["good after"] for r in res])
    for rank, r in enumerate(res):
        first = r["first"]
        want = {"fifo": ("CheckpointFileError", [f"fifo/{first}", "is a FIFO, not a regular file"]),
                "directory": ("CheckpointFileError", [f"directory/{first}", "is a directory, not a regular file"]),
                "proc mem": ("CheckpointFileError", [f"proc_mem/{first}", "failed"]),
                "key in another shard": ("MissingWeightsError", [r["key"], "index places in this file"]),
                "relabelled I32": ("UsageError", [f"relabelled_I32/{first}", "stored as torch.int32",
                                                  "is torch.float32", "integer values cannot load"]),
                "valid I32": ("UsageError", [f"valid_I32/{first}", repr(r["key"]), "stored as torch.int32"])}
        for case, (kind, words) in want.items():
            got_kind, msg = r[case]
            assert got_kind == kind and all(w in msg for w in words), (rank, case, r[case])


def test_save_through_symlink_concurrent_saves_and_dcp_errors(pool4, tmp_path):
    """save_distributed into a symlink to a directory raised 'Cannot call rmtree on a symbolic link'
    after succeeding, and left the link a directory; a second save into a place another job is saving
    into mixed or deleted files (CheckpointException ranks:dict_keys([0])); a failed
    load_distributed raised DCP's CheckpointException, a BaseException that `except Exception` misses.
    Now: the link's directory is replaced and the link kept; a second writer is refused on every rank
    (here the test process holds the lock, as a running save does); the failed load raises
    CheckpointFileError naming the rank and the cause."""
    import fcntl

    from autopar.checkpoint import files as F

    held = []
    for lock in (str(tmp_path / "held") + F.LOCK, str(tmp_path / "held_hf" / (".autopar-save" + F.LOCK))):
        os.makedirs(os.path.dirname(lock), exist_ok=True)
        fd = os.open(lock, os.O_CREAT | os.O_RDWR)
        fcntl.flock(fd, fcntl.LOCK_EX)
        held.append(fd)
    try:
        res = pool4.run(C.save_refusals, str(tmp_path))
    finally:
        for fd in held:
            os.close(fd)
    assert not failures([r["load through link"] for r in res])
    for rank, r in enumerate(res):
        assert r["symlink saves"] == [(None, "")] * 2, (rank, r["symlink saves"])
        assert r["link still a link"] and r["real holds"] == [".metadata"], (rank, r)
        assert r["siblings"] == ["link_dcp", "real_dcp"], (rank, r["siblings"])
        for case, what in (("held dcp", "save_distributed"), ("held hf", "save_pretrained")):
            kind, msg = r[case]
            assert kind == "UsageError" and f"another {what} into" in msg and "is running" in msg, (rank, r[case])
        assert r["held dirs"] == [".autopar-save" + F.LOCK], (rank, r["held dirs"])  # nothing written, nothing removed
        kind, msg = r["broken"]
        assert kind == "CheckpointFileError" and "load_distributed" in msg and "rank " in msg, (rank, r["broken"])


def test_grid_inherits_the_process_group_timeout(tmp_path):
    """parallelize(timeout=None) promised the process group's timeout, but the grid's row and column
    groups got torch's 30-minute default: with init_process_group(timeout=5 s) the others waited out a
    sleeping rank. Now ranks 0-2 raise CollectiveError within 15 s, the grid's timeout being 5 s."""
    hung = _spawn(C.slow_rank_group_timeout, 4, tmp_path).join(ranks=range(3), timeout=120)  # rank 3 sleeps
    assert not hung, hung
    for rank in range(3):
        kind, elapsed, timeout, msg = (tmp_path / f"rank{rank}.txt").read_text().split("\n", 3)
        assert timeout == "0:00:05", (rank, timeout)
        assert kind in ("CollectiveError", "RankFailedError") and float(elapsed) < 15, (rank, kind, elapsed, msg)


def test_save_switches_by_index_and_keeps_unlisted_files(pool4, tmp_path):
    """save_pretrained deleted a user's model-00001-of-00003.safetensors that no index listed, and a
    kill between the final renames left old and new shards mixed that loaded without error. Now the
    new shards take names no file has, the index switches, and only files the old index listed are
    removed: the user's files survive two sharded saves, and a save dying at the switch leaves the
    directory as it was, loading the previous weights exactly, on every rank."""
    res = pool4.run(C.switch_keeps_one_checkpoint, str(tmp_path))
    assert not failures([r["errs"] for r in res])
    r = res[0]
    users = {f"model-00001-of-{k:05d}.safetensors" for k in range(2, 10)}
    assert all(text == f"user file {u}" for u, text in r["users"].items()) and set(r["users"]) == users, r["users"]
    first, second = r["saves"]
    assert len(first) > 1 and len(second) > 1 and not set(first) & set(second), r["saves"]
    assert not set(first) & set(r["listing"]), r["listing"]  # the first save's shards were removed
    assert set(r["listing"]) == users | set(second) | {"config.json", "model.safetensors.index.json"}, r["listing"]
    for rank, res_r in enumerate(res):
        kind, msg = res_r["failed save"]
        assert kind == "CheckpointFileError" and "finishing failed on rank 0" in msg, (rank, res_r["failed save"])
        assert res_r["files unchanged"], rank


def test_a_rank_retrying_after_a_failure_raises_everywhere(tmp_path):
    """One rank failing mid-forward, catching it and calling again (every rank retries once) left all
    4 ranks blocked past a 120 s group timeout: the grid's groups had torch's 30-minute default. With
    init_process_group(timeout=5 s) every rank's retry now raises CollectiveError within two timeouts."""
    hung = _spawn(C.retry_after_a_failure, 4, tmp_path).join(timeout=120)
    assert not hung, f"a rank hung: {hung}"
    for rank in range(4):
        kinds, elapsed = (tmp_path / f"rank{rank}.txt").read_text().split("\n")
        first, second = kinds.split()
        assert first == ("RuntimeError" if rank == 1 else "CollectiveError") and second == "CollectiveError", \
            (rank, kinds)
        assert float(elapsed) < 20, (rank, elapsed)


def test_a_plain_module_checkpoint_loads_into_the_unmodified_model(pool4, tmp_path):
    """MyGPT().load_state_dict(pm.state_dict()) failed (mixed DTensor and Tensor) and
    torch.save(pm.state_dict()) on one rank wrote that rank's blocks with no word. save_pretrained
    writes full tensors under the model's own names (a tied head too) and load_full_state_dict reads
    them for a strict load_state_dict, bit for bit; torch.save of the blocks warns, naming those calls."""
    res = pool4.run(C.plain_module_roundtrip, str(tmp_path / "ckpt"))
    assert failures([r["errs"] for r in res]) == {}
    for rank, r in enumerate(res):
        assert (r["missing"], r["unexpected"]) == ([], []), (rank, r)
        assert r["keys"] == r["model keys"] and "head.weight" in r["keys"], (rank, r["keys"])
        assert r["tied shares"], rank  # load_state_dict copies into the tied parameter: still one tensor
        assert len(r["said"]) == 1 and "autopar.save_pretrained(pmodel, directory)" in r["said"][0] \
            and "autopar.load_full_state_dict(directory)" in r["said"][0], (rank, r["said"])
        assert r["warnings after deepcopy"] == 1, (rank, r)  # copying the dict is not saving it


def test_peft_lora_checkpoints_round_trip_both_ways(pool4, tmp_path):
    """A parallelized peft model saved `base_model.model.` keys and a config naming PeftModel (transformers
    loaded it with every weight missing) and pm.save_pretrained raised AttributeError. Now the adapter is
    written under peft's own keys (the same as peft writes), the base under its own names, merged weights
    on request, and peft's adapter loads into autopar.from_pretrained: every output equals the one-process
    peft model's (fp32 parity tolerances), on every rank."""
    res = pool4.run(C.peft_roundtrip, str(tmp_path))
    assert failures([r["errs"] for r in res]) == {}
    for rank, r in enumerate(res):
        assert r["files"] == ["adapter_config.json", "adapter_model.safetensors", "base"], (rank, r["files"])
        assert r["adapter keys"] == r["peft keys"] and r["adapter keys"], (rank, r["adapter keys"], r["peft keys"])
        assert r["trainable"] and all(".lora_" in n for n in r["trainable"]), (rank, r["trainable"])


def test_pmodel_save_pretrained_is_there_after_import_autopar():
    """`pmodel.save_pretrained(path)` (as transformers and peft name it) is registered by the checkpoint
    layer; a program that only did `import autopar; autopar.parallelize(...)` must have it too."""
    import subprocess
    import sys

    code = ("import autopar; autopar.parallelize; from autopar.parallel.module import EXTENSIONS; "
            "print(sorted(EXTENSIONS))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "['save_pretrained']", (out.stdout, out.stderr[-2000:])
