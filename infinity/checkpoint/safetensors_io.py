"""A streaming safetensors writer: the header first (every tensor's name, dtype, shape and place are known before
any value is), then each tensor's bytes written where they belong, in pieces and in any order. So a file of any
size is written holding one piece in memory. The format (8-byte little-endian header length, a JSON header padded
to 8 bytes, the raw little-endian data) is what the `safetensors` library and transformers read.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass

import torch

_CODES = {
    torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64", torch.int64: "I64",
    torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
}  # fmt: skip


@dataclass(frozen=True, slots=True)
class Entry:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class SafetensorsWriter:
    """Opens ``path`` and writes its header; ``write(name, values, first)`` puts flat elements from ``first``."""

    def __init__(self, path: str, entries: list[Entry], metadata: dict[str, str] | None = None) -> None:
        self.path = path
        self.offsets: dict[str, tuple[Entry, int]] = {}
        header: dict = {"__metadata__": {"format": "pt", **(metadata or {})}}
        position = 0
        for entry in entries:
            if entry.dtype not in _CODES:
                raise ValueError(f"{entry.name}: dtype {entry.dtype} has no safetensors code")
            header[entry.name] = {"dtype": _CODES[entry.dtype], "shape": list(entry.shape),
                                  "data_offsets": [position, position + entry.nbytes]}  # fmt: skip
            self.offsets[entry.name] = (entry, position)
            position += entry.nbytes
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        self.data_start = 8 + len(text)
        self.size = self.data_start + position
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.pwrite(self.fd, struct.pack("<Q", len(text)) + text, 0)
        os.ftruncate(self.fd, self.size)

    def write(self, name: str, values: torch.Tensor, first: int = 0) -> None:
        entry, start = self.offsets[name]
        # a copy: numpy's view of a tensor's storage makes it non-resizable (stage 3 frees its units that way)
        values = values.detach().reshape(-1).to(device="cpu", dtype=entry.dtype, copy=True)
        if first + values.numel() > math.prod(entry.shape):
            raise ValueError(f"{name}: elements {first}..{first + values.numel()} past its {entry.shape}")
        data = memoryview(values.view(torch.uint8).numpy())
        offset = self.data_start + start + first * entry.dtype.itemsize
        done = 0
        while done < len(data):
            done += os.pwrite(self.fd, data[done:], offset + done)

    def close(self) -> None:
        if self.fd >= 0:
            os.fsync(self.fd)
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
