"""File-level safety for checkpoints: where a save may write, which files it may replace or remove,
and how a directory is swapped in whole.

`save_pretrained` writes into a directory that may hold other things (a tokenizer, a README), so it
replaces only the files it writes, each one atomically (written under a temporary name next to it,
then `os.replace`d), and removes only weight files of autopar's / transformers' naming pattern that
the new save no longer lists. `save_distributed` writes a whole directory and swaps it in.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import time

from autopar.errors import CheckpointFileError, CheckpointPermissionError, UsageError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
TMP = ".tmp-autopar"  # suffix of everything a save writes before it is complete
WEIGHTS = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors")  # what a save (ours or transformers') names weights
OURS = re.compile(rf"(model(-\d{{5}}-of-\d{{5}})?\.safetensors|{re.escape(INDEX)}|config\.json){re.escape(TMP)}")


def shard_name(i: int, n: int) -> str:
    return SINGLE if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def check_target(path) -> str:
    """Make `path` a writable directory (created with its parents if missing) and remove temporary
    files an interrupted save left in it; returns it. A symlink to a directory is written through."""
    path = os.fspath(path)
    if not path:
        raise UsageError("save path '' is empty: expected a directory to write the checkpoint into")
    if os.path.islink(path) and not os.path.exists(path):
        raise UsageError(f"save path {path!r} is a symlink to {os.readlink(path)!r}, which does not exist: "
                         f"create that directory or pass another path")
    if os.path.exists(path) and not os.path.isdir(path):
        raise UsageError(f"save path {path!r} is a file, not a directory: a checkpoint is a directory of "
                         f"files; pass a directory path (it is created if missing)")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise CheckpointFileError(f"cannot create the save directory {path!r}: {e.strerror or e}; check that "
                                  f"its parent exists, is a directory and is writable") from e
    if not os.access(path, os.W_OK | os.X_OK):
        raise CheckpointPermissionError(f"save directory {path!r} is not writable by this process: change "
                                        f"its permissions or pass another path")
    for name in os.listdir(path):
        if OURS.fullmatch(name) and os.path.isfile(os.path.join(path, name)):
            os.remove(os.path.join(path, name))  # a save killed before it finished left it
    return path


def temp_path(directory: str, name: str) -> str:
    return os.path.join(directory, name + TMP)


def remove_quietly(paths) -> None:
    """Remove what a failed save wrote under temporary names (best effort: the save already failed)."""
    for p in paths:
        try:
            os.remove(p)
        except FileNotFoundError:
            pass


def stale_weights(directory: str, written: set) -> list:
    """Weight files of a previous save that the new one (which wrote `written`) does not list:
    shards of another count, a single model.safetensors when now sharded, the index when now single
    (listed first: removed before the shards it names, a loader never follows it to a missing file)."""
    single_now = SINGLE in written
    stale = []
    for name in sorted(os.listdir(directory), key=lambda n: (n != INDEX, n)):
        ours = WEIGHTS.fullmatch(name) or (name == INDEX and single_now)
        if ours and name not in written and os.path.isfile(os.path.join(directory, name)):
            stale.append(name)
    return stale


def fsync_dir(directory: str) -> None:
    """Make the renames in `directory` durable (a crash after return keeps them)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _exchange(a: str, b: str) -> bool:
    """Atomically swap two directory entries (Linux renameat2 RENAME_EXCHANGE); False if unavailable."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def replace_dir(new: str, path: str) -> None:
    """Put the complete directory `new` at `path`. With an existing `path` the two are swapped in one
    atomic step where the OS allows (a reader sees the old or the new checkpoint, never neither);
    elsewhere the old one is moved aside first and, if the process dies in between, is left at
    `path.old-autopar-<time>`."""
    if not os.path.exists(path):
        os.replace(new, path)
        return
    if _exchange(new, path):
        shutil.rmtree(new)  # now holds the old checkpoint
        return
    old = f"{path}.old-autopar-{int(time.time())}"
    os.replace(path, old)
    os.replace(new, path)
    shutil.rmtree(old)
