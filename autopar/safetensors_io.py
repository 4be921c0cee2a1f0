"""Reading slices of safetensors files with plain reads, and writing shards.

A rank reads only the bytes of its block: the block's contiguous runs are read with `os.pread` into
the block's own buffer, so nothing of the file is mapped and a rank's memory grows by its blocks
alone (a memory-mapped read of a column block would touch, and count, every row's pages).

Format (https://github.com/huggingface/safetensors): 8-byte little-endian header length, a JSON
header {name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}, then data.
"""

from __future__ import annotations

import json
import math
import os
import struct

import torch

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


class SafetensorsFile:
    def __init__(self, path: str):
        self.path = path
        self.fd = os.open(path, os.O_RDONLY)
        (n,) = struct.unpack("<Q", os.pread(self.fd, 8, 0))
        header = json.loads(os.pread(self.fd, n, 8))
        header.pop("__metadata__", None)
        self.base = 8 + n
        self.entries = header

    def close(self):
        os.close(self.fd)

    def keys(self):
        return self.entries.keys()

    def shape(self, name: str) -> tuple:
        return tuple(self.entries[name]["shape"])

    def read(self, name: str, ranges: list) -> torch.Tensor:
        """The block [r0:r1, ...] of tensor `name`; `ranges` has one (start, stop) per dim."""
        e = self.entries[name]
        dtype = DTYPES[e["dtype"]]
        shape = e["shape"]
        elt = torch.empty((), dtype=dtype).element_size()
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
        data = os.pread(self.fd, nbytes, offset)
        if len(data) != nbytes:
            raise OSError(f"{self.path}: short read at byte {offset} ({len(data)} of {nbytes})")
        flat[pos:pos + nbytes] = torch.frombuffer(bytearray(data), dtype=torch.uint8)


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
