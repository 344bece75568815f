"""The on-disk format: a Zarr v3 store of uncompressed arrays, written and read by byte range.

[Note: zarr layout]
Every array is a Zarr v3 array (``zarr.json`` + one file per chunk beside it: the default chunk key encoding with
the "." separator, so ``c.0.0`` and no folder per chunk; the little-endian "bytes" codec and nothing else). The
chunk grid is regular and cuts only the first dimension into near-equal parts of at most CHUNK_BYTES: a chunk is
``chunk_rows`` whole rows, so it is one contiguous run of the array's flat (C-order) elements, and a chunk file is
exactly those elements' bytes (an edge chunk is padded with the fill value to the full chunk shape, as Zarr
requires). That is why a rank can write a chunk from flat pieces and a reader can fetch any flat range with one
read per chunk. Any Zarr v3 reader (zarr-python, tensorstore) opens the arrays; no library is needed here.

bfloat16 has no Zarr v3 core data type: such arrays are stored as float32 (exact) and cast back on load.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import torch

from infinity.errors import CheckpointError

CHUNK_BYTES = 8 << 20  # target bytes per chunk: large enough for few files, small enough to exchange a boundary

_ZARR_TYPES = {
    torch.float32: "float32", torch.float64: "float64", torch.float16: "float16",
    torch.int64: "int64", torch.int32: "int32", torch.int16: "int16", torch.int8: "int8", torch.uint8: "uint8",
    torch.bool: "bool",
}  # fmt: skip
_TORCH_TYPES = {name: dtype for dtype, name in _ZARR_TYPES.items()}


def storage_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype an array of ``dtype`` is stored in (bfloat16 -> float32, exactly)."""
    if dtype == torch.bfloat16:
        return torch.float32
    if dtype not in _ZARR_TYPES:
        raise CheckpointError(f"tensors of dtype {dtype} cannot be stored in a checkpoint")
    return dtype


@dataclass(frozen=True, slots=True)
class ArrayMeta:
    """One array's shape, stored dtype and chunking ([Note: zarr layout])."""

    shape: tuple[int, ...]
    dtype: torch.dtype  # as stored
    chunk_rows: int  # rows of the first dimension per chunk (1 for a 0-d array)

    @classmethod
    def plan(cls, shape: tuple[int, ...], dtype: torch.dtype, chunk_bytes: int = CHUNK_BYTES) -> ArrayMeta:
        dtype = storage_dtype(dtype)
        if not shape:
            return cls((), dtype, 1)
        row_bytes = max(math.prod(shape[1:]) * dtype.itemsize, 1)
        rows = max(shape[0], 1)
        chunks = max(1, -(-rows * row_bytes // chunk_bytes))
        return cls(tuple(shape), dtype, -(-rows // chunks))  # equal chunks: the edge one is padded by < chunks rows

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def chunk_numel(self) -> int:
        """Elements per chunk file (an edge chunk is padded to this)."""
        return self.chunk_rows * math.prod(self.shape[1:]) if self.shape else 1

    @property
    def num_chunks(self) -> int:
        if not self.shape:
            return 1
        return max(1, -(-self.shape[0] // self.chunk_rows)) if self.numel else 0

    def chunk_range(self, index: int) -> tuple[int, int]:
        """[start, end) of chunk ``index`` in flat elements (end clipped to the array)."""
        start = index * self.chunk_numel
        return start, min(start + self.chunk_numel, self.numel)

    def chunk_key(self, index: int) -> str:
        if not self.shape:
            return "c"
        return "c." + ".".join([str(index)] + ["0"] * (len(self.shape) - 1))

    @property
    def chunk_bytes(self) -> int:
        return self.chunk_numel * self.dtype.itemsize

    def to_json(self) -> dict:
        fill = False if self.dtype == torch.bool else (0.0 if self.dtype.is_floating_point else 0)
        return {
            "zarr_format": 3,
            "node_type": "array",
            "shape": list(self.shape),
            "data_type": _ZARR_TYPES[self.dtype],
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": self._chunk_shape()}},
            "chunk_key_encoding": {"name": "default", "configuration": {"separator": "."}},
            "fill_value": fill,
            "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}],
            "attributes": {},
        }

    def _chunk_shape(self) -> list[int]:
        return [self.chunk_rows, *self.shape[1:]] if self.shape else []

    @classmethod
    def from_json(cls, meta: dict, where: str) -> ArrayMeta:
        try:
            if meta["zarr_format"] != 3 or meta["node_type"] != "array":
                raise ValueError("not a Zarr v3 array")
            codecs = meta["codecs"]
            if [c["name"] for c in codecs] != ["bytes"] or codecs[0].get("configuration", {}).get("endian") not in (
                None, "little"
            ):  # fmt: skip
                raise ValueError(f"codecs {codecs} (only the little-endian bytes codec is read)")
            shape = tuple(int(n) for n in meta["shape"])
            chunk_shape = [int(n) for n in meta["chunk_grid"]["configuration"]["chunk_shape"]]
            dtype = _TORCH_TYPES[meta["data_type"]]
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{where}: not an array this checkpoint format writes ({e})") from None
        found = cls(shape, dtype, chunk_shape[0] if shape else 1)
        if chunk_shape != found._chunk_shape():
            raise CheckpointError(f"{where}: chunk shape {chunk_shape} cuts more than the first dimension")
        return found


def write_json(path: str, value: dict) -> None:
    with open(path, "w") as f:
        json.dump(value, f, indent=1)
        f.write("\n")


def read_json(path: str, what: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{what} is missing: {path}") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{what} cannot be read: {path}: {e}") from None


def write_group(root: str, key: str = "") -> None:
    """A Zarr v3 group node at ``key`` (the store root when empty)."""
    folder = os.path.join(root, key)
    os.makedirs(folder, exist_ok=True)
    write_json(os.path.join(folder, "zarr.json"), {"zarr_format": 3, "node_type": "group", "attributes": {}})


def write_array_meta(root: str, key: str, meta: ArrayMeta) -> None:
    folder = os.path.join(root, key)
    os.makedirs(folder, exist_ok=True)
    write_json(os.path.join(folder, "zarr.json"), meta.to_json())


def read_array_meta(root: str, key: str) -> ArrayMeta:
    path = os.path.join(root, key, "zarr.json")
    return ArrayMeta.from_json(read_json(path, f"array {key!r}"), path)


def _bytes_of(values: torch.Tensor) -> memoryview:
    return memoryview(values.contiguous().numpy()).cast("B")


def chunk_path(root: str, key: str, meta: ArrayMeta, index: int) -> str:
    return os.path.join(root, key, meta.chunk_key(index))


def check_chunk_values(key: str, meta: ArrayMeta, index: int, values: torch.Tensor) -> None:
    start, end = meta.chunk_range(index)
    if values.numel() != end - start or values.dtype != meta.dtype:
        raise ValueError(f"chunk {index} of {key}: got {values.numel()} x {values.dtype}, want {end - start}")


def check_chunk_file(root: str, key: str, meta: ArrayMeta, index: int) -> str:
    """The chunk file's path, once it is known to exist with the full chunk's size."""
    path = chunk_path(root, key, meta, index)
    try:
        found = os.stat(path).st_size
    except FileNotFoundError:
        raise CheckpointError(f"array {key!r}: chunk {meta.chunk_key(index)} is missing ({path})") from None
    if found != meta.chunk_bytes:
        raise CheckpointError(
            f"array {key!r}: chunk {meta.chunk_key(index)} has {found} bytes, expected {meta.chunk_bytes} ({path})"
        )
    return path


def write_chunk(root: str, key: str, meta: ArrayMeta, index: int, values: torch.Tensor) -> str:
    """Writes chunk ``index`` (``values``: its elements, flat, the stored dtype; an edge chunk is padded here),
    synchronously, through the page cache (checkpoint/chunk_io.py is the engine's fast path). Returns the path."""
    check_chunk_values(key, meta, index, values)
    path = chunk_path(root, key, meta, index)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        _write_all(fd, _bytes_of(values), path)
        padding = (meta.chunk_numel - values.numel()) * meta.dtype.itemsize
        if padding:
            _write_all(fd, memoryview(bytes(padding)), path)
    finally:
        os.close(fd)
    return path


def _write_all(fd: int, data: memoryview, path: str) -> None:
    done = 0
    while done < len(data):
        try:
            done += os.write(fd, data[done:])
        except OSError as e:
            raise CheckpointError(f"writing {path}: {e.strerror} (errno {e.errno}); free space or pick another "
                                  "save_dir") from None  # fmt: skip


def chunk_spans(meta: ArrayMeta, start: int, end: int):
    """(chunk index, lo, hi, chunk start): the parts of flat range [start, end) in each chunk."""
    if end <= start:
        return
    for index in range(start // meta.chunk_numel, (end - 1) // meta.chunk_numel + 1):
        c0, c1 = meta.chunk_range(index)
        yield index, max(start, c0), min(end, c1), c0


def read_range(root: str, key: str, meta: ArrayMeta, start: int, end: int) -> torch.Tensor:
    """Flat elements [start, end) of the array, one pread per chunk; a missing or short chunk is a
    CheckpointError naming its file."""
    out = torch.empty(end - start, dtype=meta.dtype)
    if end <= start:
        return out
    view = _bytes_of(out)
    size = meta.dtype.itemsize
    for index, lo, hi, c0 in chunk_spans(meta, start, end):
        path = check_chunk_file(root, key, meta, index)
        fd = os.open(path, os.O_RDONLY)
        try:
            target = view[(lo - start) * size : (hi - start) * size]
            got = os.preadv(fd, [target], (lo - c0) * size)
            if got != len(target):
                raise CheckpointError(f"array {key!r}: short read of {path} ({got} of {len(target)} bytes)")
        finally:
            os.close(fd)
    return out
