"""Which rank writes which chunk, and the assembly of chunks from the flat pieces each rank holds.

[Note: chunk ownership]
Ranks never write the same chunk file. For an array every rank holds whole (replicated: buffers, frozen parameters
below stage 3, everything at stage 0) chunk k is written by rank k % world_size, so the writes are spread. For a
partitioned array each rank holds one contiguous flat range (its piece of the parameter's bucket or unit), which
does not fall on chunk boundaries; chunk k is written by the rank holding its first element, and the few elements
of that chunk held by the next rank travel to it in an exchange (one all-gather of small pieces per bucket or unit,
so at most one boundary chunk per rank and array waits in memory). Everything else is written as it is visited.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from infinity.checkpoint.chunk_io import ChunkIO
from infinity.checkpoint.zarr_store import ArrayMeta, check_chunk_values, chunk_path
from infinity.comm import Comm
from infinity.errors import CheckpointError


def announced(error: BaseException) -> BaseException:
    """Marks an error every rank knows about (so none waits for the others in a collective any more)."""
    error.announced = True
    return error


def agree_ok(comm: Comm, error: BaseException | None, what: str) -> None:
    """Collective: every rank says whether it failed; if any did, every rank raises (a CheckpointError naming the
    failed rank, or its own error). So one rank's failure never leaves the others waiting in a collective."""
    if error is not None and getattr(error, "announced", False):
        raise error
    if not comm.active:
        if error is not None:
            raise error
        return
    gathered: list = [None] * comm.world_size
    # the payload of ChunkWriter.exchange: a rank that failed after an exchange meets the others' next one here
    mine = ("error", f"{type(error).__name__}: {error}") if error is not None else ("ok", [])
    dist.all_gather_object(gathered, mine, group=comm.group)
    if error is not None:
        raise announced(error)
    failed = [(rank, detail) for rank, (status, detail) in enumerate(gathered) if status == "error"]
    if failed:
        raise announced(CheckpointError(f"{what} failed on rank {failed[0][0]}: {failed[0][1]}"))


@dataclass(frozen=True, slots=True)
class ArraySpec:
    """An array of the checkpoint and who holds it ([Note: chunk ownership])."""

    key: str
    meta: ArrayMeta
    owners: tuple[tuple[int, int], ...] | None = None  # per rank: the flat [start, end) it holds; None: all of it

    def writer_of(self, chunk: int, world_size: int) -> int:
        if self.owners is None:
            return chunk % world_size
        first = chunk * self.meta.chunk_numel
        for rank, (start, end) in enumerate(self.owners):
            if start <= first < end:
                return rank
        raise CheckpointError(f"array {self.key!r}: no rank holds element {first} (owners {self.owners})")


@dataclass(slots=True)
class _Partial:
    values: torch.Tensor
    missing: int


@dataclass(slots=True)
class ChunkWriter:
    """Writes this rank's chunks from the flat pieces it is given (``put``), wherever the pieces fall."""

    root: str
    specs: dict[str, ArraySpec]
    comm: Comm
    io: ChunkIO
    written: list[str] = field(default_factory=list)  # this rank's files: for fsync, and removal if the save fails
    bytes_written: int = 0
    _partial: dict[tuple[str, int], _Partial] = field(default_factory=dict)
    _outgoing: list[tuple[str, int, torch.Tensor]] = field(default_factory=list)

    def put(self, key: str, start: int, values: torch.Tensor) -> None:
        """Flat elements [start, start + numel) of array ``key`` as held here (any dtype: cast to the stored one)."""
        spec = self.specs[key]
        meta = spec.meta
        values = values.detach().reshape(-1).to(device="cpu", dtype=meta.dtype)
        end = start + values.numel()
        position = start
        while position < end:
            chunk = position // meta.chunk_numel
            c0, c1 = meta.chunk_range(chunk)
            take = min(end, c1) - position
            piece = values[position - start : position - start + take]
            writer = spec.writer_of(chunk, self.comm.world_size)
            if writer != self.comm.rank:
                if spec.owners is not None:  # the writer does not hold these elements: they travel to it
                    self._outgoing.append((key, position, piece.clone()))
            elif position == c0 and take == c1 - c0:
                self._write(key, meta, chunk, piece)
            else:
                partial = self._partial.get((key, chunk))
                if partial is None:
                    partial = self._partial[(key, chunk)] = _Partial(torch.zeros(c1 - c0, dtype=meta.dtype), c1 - c0)
                partial.values[position - c0 : position - c0 + take].copy_(piece)
                partial.missing -= take
                if partial.missing == 0:
                    del self._partial[(key, chunk)]
                    self._write(key, meta, chunk, partial.values)
            position += take

    def _write(self, key: str, meta: ArrayMeta, chunk: int, values: torch.Tensor) -> None:
        check_chunk_values(key, meta, chunk, values)
        path = chunk_path(self.root, key, meta, chunk)
        self.written.append(path)  # before the write: a failed save removes the file it was making too
        self.io.write(path, values, meta.chunk_bytes)
        self.bytes_written += meta.chunk_bytes

    def drain(self) -> None:
        """The writes issued so far have landed: the memory they read may change hands."""
        self.io.drain()

    def exchange(self, error: BaseException | None = None) -> None:
        """Collective: pieces held here for chunks another rank writes go to it (every rank calls this at the same
        points: after each bucket or unit). A rank that failed passes its ``error`` instead: every rank then raises
        (the error is ``announced``: nobody waits for it in a later collective)."""
        if not self.comm.active:
            if self._outgoing:
                raise CheckpointError(f"array {self._outgoing[0][0]!r}: pieces for another rank at world size 1")
            return
        gathered: list = [None] * self.comm.world_size
        mine = ("error", f"{type(error).__name__}: {error}") if error is not None else ("ok", self._outgoing)
        dist.all_gather_object(gathered, mine, group=self.comm.group)
        self._outgoing = []
        failed = [(rank, detail) for rank, (status, detail) in enumerate(gathered) if status == "error"]
        if failed:
            if error is not None:
                error.announced = True
                raise error
            raise announced(CheckpointError(f"rank {failed[0][0]} failed: {failed[0][1]}"))
        for rank, (_, pieces) in enumerate(gathered):
            if rank == self.comm.rank:
                continue
            for key, start, values in pieces:
                spec = self.specs[key]
                if spec.writer_of(start // spec.meta.chunk_numel, self.comm.world_size) == self.comm.rank:
                    self.put(key, start, values)

    def finish(self) -> None:
        self.drain()
        if self._partial or self._outgoing:
            (key, chunk), partial = next(iter(self._partial.items())) if self._partial else ((self._outgoing[0][0], -1),
                                                                                           None)  # fmt: skip
            missing = partial.missing if partial is not None else "?"
            raise CheckpointError(f"array {key!r}: chunk {chunk} is incomplete ({missing} elements never arrived)")
