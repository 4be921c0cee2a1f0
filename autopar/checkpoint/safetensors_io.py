"""Reading slices of safetensors files with plain reads, and writing shards.

A rank reads only the bytes of its block: the block's contiguous runs are read with `os.pread` into
the block's own buffer, so nothing of the file is mapped and a rank's memory grows by its blocks
alone (a memory-mapped read of a column block would touch, and count, every row's pages).

Format (https://github.com/huggingface/safetensors): 8-byte little-endian header length, a JSON
header {name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}, then data.

The file is not trusted: before any tensor is read, the header is checked the way the safetensors
library checks it (a header length bomb, overlapping or relabelled tensors and offsets past the end
are refused with a UsageError naming the file and the field), so a read can only return bytes that
belong to the tensor it names.
"""

from __future__ import annotations

import json
import math
import os
import stat
import struct

import torch

from autopar.errors import CheckpointFileError, MissingWeightsError, UsageError

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
MAX_HEADER = 100_000_000  # bytes; the safetensors library's own cap


def open_regular(path: str) -> int:
    """A read-only descriptor of `path`, refused (CheckpointFileError naming the path) unless it is a
    regular file: opening a FIFO blocks until a writer comes (no timeout applies), a directory or a
    device is no checkpoint. The open does not block, and what it opened is checked again (the path
    may have changed in between)."""
    try:
        kind = _kind(os.stat(path).st_mode)
        if kind == "regular file":
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
            kind = _kind(os.fstat(fd).st_mode)
            if kind == "regular file":
                os.set_blocking(fd, True)
                return fd
            os.close(fd)
    except OSError as e:
        raise CheckpointFileError(f"{path}: cannot open it for reading ({e.strerror or e}); expected a readable "
                                  f"safetensors file") from e
    link = f" (a symlink to {os.path.realpath(path)!r})" if os.path.islink(path) else ""
    raise CheckpointFileError(f"{path}{link} is a {kind}, not a regular file: a checkpoint's weights must be "
                              f"regular safetensors files; replace it with the file itself")


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISREG, "regular file"), (stat.S_ISDIR, "directory"), (stat.S_ISFIFO, "FIFO"),
                       (stat.S_ISSOCK, "socket"), (stat.S_ISCHR, "character device"),
                       (stat.S_ISBLK, "block device")):
        if test(mode):
            return name
    return "special file"


class SafetensorsFile:
    def __init__(self, path: str):
        self.path = path
        self.fd = open_regular(path)
        try:
            self.base, self.entries = _read_header(self.fd, path)
        except OSError as e:  # a read the OS refuses (EIO: /proc files, a failing disk)
            os.close(self.fd)
            raise CheckpointFileError(f"{path}: reading its header failed ({e.strerror or e}); expected a "
                                      f"readable safetensors file") from e
        except BaseException:
            os.close(self.fd)
            raise

    def close(self):
        os.close(self.fd)

    def keys(self):
        return self.entries.keys()

    def entry(self, name: str) -> dict:
        """The header entry of tensor `name`; one the file lacks (an index naming the wrong shard) is refused."""
        e = self.entries.get(name)
        if e is None:
            raise MissingWeightsError(f"{self.path}: holds no tensor {name!r}, which the checkpoint's index places "
                                      f"in this file (it holds {len(self.entries)} others); the index and the "
                                      f"shards come from different saves: re-save the checkpoint")
        return e

    def dtype(self, name: str) -> torch.dtype:
        return DTYPES[self.entry(name)["dtype"]]

    def shape(self, name: str) -> tuple:
        return tuple(self.entry(name)["shape"])

    def read(self, name: str, ranges: list) -> torch.Tensor:
        """The block [r0:r1, ...] of tensor `name`; `ranges` has one (start, stop) per dim."""
        e = self.entry(name)
        dtype = DTYPES[e["dtype"]]
        shape = e["shape"]
        if len(ranges) != len(shape) or any(not 0 <= a <= b <= n for (a, b), n in zip(ranges, shape)):
            raise UsageError(f"{self.path}: block {ranges} is not inside tensor {name!r} of shape {shape}")
        elt = dtype.itemsize
        out = torch.empty([b - a for a, b in ranges], dtype=dtype)
        if out.numel() == 0:
            return out
        flat = out.view(-1).view(torch.uint8)
        # the trailing dims read whole form one contiguous run per index of the leading dims
        k = len(shape)
        while k > 0 and ranges[k - 1] == (0, shape[k - 1]):
            k -= 1
        run_dims = shape[k:] if k < len(shape) else []
        inner = math.prod(run_dims) if k < len(shape) else 1
        if k == 0:  # the whole tensor
            self._pread_into(flat, 0, self.base + e["data_offsets"][0], out.numel() * elt)
            return out
        last = ranges[k - 1]
        run = (last[1] - last[0]) * inner * elt  # bytes per run along dim k-1
        strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
        pos = 0
        for idx in _product([range(a, b) for a, b in ranges[:k - 1]]):
            offset = sum(i * strides[d] for d, i in enumerate(idx)) + last[0] * strides[k - 1]
            self._pread_into(flat, pos, self.base + e["data_offsets"][0] + offset * elt, run)
            pos += run
        return out

    def _pread_into(self, flat: torch.Tensor, pos: int, offset: int, nbytes: int):
        try:
            data = os.pread(self.fd, nbytes, offset)
        except OSError as e:
            raise CheckpointFileError(f"{self.path}: reading {nbytes} bytes at byte {offset} failed "
                                      f"({e.strerror or e})") from e
        if len(data) != nbytes:
            raise CheckpointFileError(f"{self.path}: short read at byte {offset} ({len(data)} of {nbytes})")
        flat[pos:pos + nbytes] = torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _refuse(path: str, what: str) -> UsageError:
    return UsageError(f"{path}: not a valid safetensors file: {what}; the file is damaged or was not "
                      f"written by a safetensors writer: re-download or re-save it")


def _read_header(fd: int, path: str) -> tuple:
    """(start of the data section, {name: entry}) after checking every entry against the file."""
    size = os.fstat(fd).st_size
    raw = os.pread(fd, 8, 0)
    if len(raw) != 8:
        raise _refuse(path, f"it has {size} bytes, fewer than the 8-byte header length")
    (n,) = struct.unpack("<Q", raw)
    if n > MAX_HEADER:
        raise _refuse(path, f"header length {n} bytes exceeds the {MAX_HEADER}-byte limit")
    if 8 + n > size:
        raise _refuse(path, f"header length {n} bytes runs past the end of the {size}-byte file")
    try:
        header = json.loads(os.pread(fd, n, 8).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _refuse(path, f"header is not UTF-8 JSON ({e})") from None
    if not isinstance(header, dict):
        raise _refuse(path, f"header is a JSON {type(header).__name__}, expected an object")
    meta = header.pop("__metadata__", {})
    if not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise _refuse(path, "__metadata__ must map strings to strings")
    for name, e in header.items():
        _check_entry(path, name, e)
    _check_tiling(path, header, size - 8 - n)
    return 8 + n, header


def _is_count(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _check_entry(path: str, name: str, e) -> None:
    if not (isinstance(e, dict) and {"dtype", "shape", "data_offsets"} <= set(e)):
        raise _refuse(path, f"tensor {name!r}: expected an object with dtype, shape and data_offsets, got {e!r}")
    if e["dtype"] not in DTYPES:
        raise _refuse(path, f"tensor {name!r}: dtype {e['dtype']!r} is not one of {sorted(DTYPES)}")
    shape, offsets = e["shape"], e["data_offsets"]
    if not (isinstance(shape, list) and all(_is_count(s) for s in shape)):
        raise _refuse(path, f"tensor {name!r}: shape {shape!r} must be a list of non-negative ints")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(o) for o in offsets)
            and offsets[0] <= offsets[1]):
        raise _refuse(path, f"tensor {name!r}: data_offsets {offsets!r} must be [begin, end] with 0 <= begin <= end")
    nbytes = math.prod(shape) * DTYPES[e["dtype"]].itemsize
    if offsets[1] - offsets[0] != nbytes:
        raise _refuse(path, f"tensor {name!r}: data_offsets {offsets} span {offsets[1] - offsets[0]} bytes, but "
                            f"{e['dtype']} {shape} needs {nbytes}")


def _check_tiling(path: str, header: dict, data_bytes: int) -> None:
    """Tensors must cover the data section end to end, without gaps or overlaps (as the library
    requires): then no two tensors share a byte and none reads past the file."""
    end = 0
    for name, e in sorted(header.items(), key=lambda kv: tuple(kv[1]["data_offsets"])):
        begin = e["data_offsets"][0]
        if begin != end:
            why = "overlaps the tensor before it" if begin < end else "leaves a gap after the tensor before it"
            raise _refuse(path, f"tensor {name!r}: data_offsets {e['data_offsets']} {why} (which ends at {end})")
        end = e["data_offsets"][1]
    if end != data_bytes:
        raise _refuse(path, f"the tensors cover {end} bytes of data, the file holds {data_bytes}")


def _product(ranges):
    if not ranges:
        yield ()
        return
    for i in ranges[0]:
        for rest in _product(ranges[1:]):
            yield (i,) + rest


def write(path: str, tensors: dict, metadata: dict | None = None) -> None:
    """Write `tensors` (name -> contiguous CPU tensor) as one safetensors file."""
    rev = {v: k for k, v in DTYPES.items()}
    header, offset = {}, 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        header[name] = {"dtype": rev[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    if metadata:
        header["__metadata__"] = metadata
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for t in tensors.values():
            f.write(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        f.flush()
        os.fsync(f.fileno())  # on disk before a rename makes it the checkpoint's file


def _dtype_kind(dtype: torch.dtype) -> str:
    return "bool" if dtype == torch.bool else "complex" if dtype.is_complex else \
        "floating" if dtype.is_floating_point else "integer"


def check_dtype(file: str, what: str, have: torch.dtype, want: torch.dtype) -> None:
    """A stored tensor loads into a parameter or buffer of the same kind: floating into floating (cast,
    as transformers casts to torch_dtype), an integer into an integer at least as wide. An integer
    tensor relabelled or saved into a floating parameter would load as wrong values, silently."""
    same_kind = _dtype_kind(have) == _dtype_kind(want)
    narrower = _dtype_kind(have) == "integer" and same_kind and have.itemsize > want.itemsize
    if not same_kind or narrower:
        why = "a narrowing cast could lose values" if narrower else \
            f"{_dtype_kind(have)} values cannot load into a {_dtype_kind(want)} tensor"
        raise UsageError(f"{file}: tensor {what!r} is stored as {have}, but the model's tensor is {want} "
                         f"({why}); the checkpoint was written for another model or its header was altered: "
                         f"re-save it from the model, or convert the tensor to {want} yourself")
