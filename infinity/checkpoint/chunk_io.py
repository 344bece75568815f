"""Chunk files moved through the asynchronous I/O engine (infinity/aio), many in flight at once.

Saving and loading a checkpoint is the same traffic the NVMe tier makes: large contiguous transfers. So the chunk
files go through an AioHandle with the run's ``aio`` settings (O_DIRECT bodies, queue_depth requests in flight,
unaligned memory staged through aligned buffers): the data goes straight to the disk, not through the page cache
(which a save would have to flush anyway before it is durable). Requests are issued as pieces arrive and waited
for in ``drain()``, which the caller runs before the memory they read or fill changes hands (a tile's segment is
given back, a unit's piece is dropped). At most ``max_in_flight_bytes`` are queued (the plan's
checkpoint_io_bytes: [Note: one plan] in memory/plan.py); an I/O error becomes a
CheckpointError naming the file.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable

import torch

from infinity.aio import AioHandle, AioSettings
from infinity.errors import AioError, CheckpointError


class ChunkIO:
    def __init__(self, settings: AioSettings | None = None, *, max_in_flight_bytes: int) -> None:
        self.handle = AioHandle.from_settings(settings or AioSettings())
        self.max_in_flight_bytes = max_in_flight_bytes
        self._pending: deque = deque()  # (request, tensor kept alive, then: callable | None)
        self._bytes = 0

    def write(self, path: str, values: torch.Tensor, file_bytes: int) -> None:
        """A new file of ``file_bytes`` bytes starting with ``values`` (the rest zeros: an edge chunk's padding)."""
        values = values.detach().contiguous()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.ftruncate(fd, file_bytes)
        except OSError as e:
            raise CheckpointError(f"writing {path}: {e.strerror} (errno {e.errno}); free space or pick another "
                                  "save_dir") from None  # fmt: skip
        finally:
            os.close(fd)
        self._queue(self.handle.submit_pwrite(values, path), values, None)

    def read(self, path: str, out: torch.Tensor, offset: int, then: Callable[[], None] | None = None) -> None:
        """out <- the file's bytes from ``offset`` (``out`` contiguous); ``then()`` runs once they have landed."""
        self._queue(self.handle.submit_pread(out, path, offset), out, then)

    def _queue(self, request, tensor: torch.Tensor, then) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        self._pending.append((request, tensor, then, nbytes))
        self._bytes += nbytes
        while self._bytes > self.max_in_flight_bytes and len(self._pending) > 1:
            self._finish_one()

    def _finish_one(self) -> None:
        request, _, then, nbytes = self._pending.popleft()
        self._bytes -= nbytes
        try:
            request.wait()
        except AioError as e:
            raise CheckpointError(f"checkpoint file {e.path}: {e}") from e
        if then is not None:
            then()

    def drain(self) -> None:
        """Waits for every queued transfer (and runs what follows each read)."""
        while self._pending:
            self._finish_one()

    def close(self) -> None:
        try:
            while self._pending:
                request = self._pending.popleft()[0]
                request.exception()  # wait; the first error was raised by drain() already
        finally:
            self.handle.close()
