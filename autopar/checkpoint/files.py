"""File-level safety for checkpoints: where a save may write, which files it may replace or remove,
and how a directory is swapped in whole.

`save_pretrained` writes into a directory that may hold other things (a tokenizer, a README), so it
writes each file under a temporary name next to it and `os.replace`s it into place. A sharded save's
new shards take names no file there has (`shard_names`), and the new index, renamed into place last,
switches a reader from the old complete set to the new one; only then are the previous checkpoint's
weight files (those its index listed, `previous_weights`) removed, and no other file.
`save_distributed` writes a whole directory and swaps it in.
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import os
import re
import secrets
import shutil
import time

from autopar.errors import CheckpointFileError, CheckpointPermissionError, UsageError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
TMP = ".tmp-autopar"  # suffix of everything a save writes before it is complete
LOCK = ".lock-autopar"  # suffix of the lock a running save holds (SaveLock)
OURS = re.compile(rf"(model(-\d{{5}}-of-\d{{5}}(-[0-9a-f]{{8}})?)?\.safetensors|{re.escape(INDEX)}|config\.json)"
                  rf"{re.escape(TMP)}")


class SaveLock:
    """An exclusive lock held by one save at a time (rank 0's), on the file `path`: `flock`, which the
    OS releases when the holder dies, so a killed save never leaves it held. The file is removed at
    release; a taker that locked a file its previous holder had just removed takes the new one."""

    def __init__(self, path: str, what: str):
        self.path, self.what, self.fd = path, what, None

    def acquire(self) -> None:
        while True:
            fd = os.open(self.path, os.O_CREAT | os.O_RDWR, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise UsageError(f"another {self.what} is running (it holds {self.path}): two saves into one place "
                                 f"would mix their files; wait for it to finish, or save elsewhere") from None
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                self.fd = fd
                return
            os.close(fd)

    def release(self) -> None:
        if self.fd is not None:
            remove_quietly([self.path])
            os.close(self.fd)
            self.fd = None


def shard_name(i: int, n: int) -> str:
    return SINGLE if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def check_target(path, lock: SaveLock | None = None) -> str:
    """Make `path` a writable directory (created with its parents if missing), take `lock` (refused
    if another save holds it) and remove temporary files an interrupted save left in it; returns it.
    A symlink to a directory is written through."""
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
    if lock is not None:
        lock.acquire()
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


def shard_names(directory: str, n: int) -> list:
    """The file names of a save of `n` shards into `directory`: model.safetensors for one; else
    transformers' model-0000i-of-0000n.safetensors, unless a file of one of those names is already
    there (the previous save's, which must stay whole until the new index replaces it, or a file of
    the user's), then the same names tagged with a random suffix."""
    if n == 1:
        return [SINGLE]
    names = [shard_name(i, n) for i in range(n)]
    if any(os.path.lexists(os.path.join(directory, name)) for name in names):
        tag = secrets.token_hex(4)
        names = [f"model-{i + 1:05d}-of-{n:05d}-{tag}.safetensors" for i in range(n)]
    return names


def previous_weights(directory: str) -> list:
    """The weight files of the checkpoint now in `directory`: the files its index lists (names inside
    it) and a single model.safetensors. Only these may a new save remove; a file no index lists,
    whatever its name, is not a checkpoint's and stays."""
    listed = set()
    index = os.path.join(directory, INDEX)
    if os.path.isfile(index):
        try:
            with open(index) as fh:
                weight_map = json.load(fh).get("weight_map") or {}
            listed = {v for v in weight_map.values() if isinstance(v, str) and os.path.basename(v) == v}
        except (OSError, ValueError, AttributeError):
            listed = set()  # an unreadable index lists nothing we could trust
    if os.path.isfile(os.path.join(directory, SINGLE)):
        listed.add(SINGLE)
    return sorted(n for n in listed if os.path.isfile(os.path.join(directory, n)))


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
