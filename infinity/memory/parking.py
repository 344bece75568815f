"""Parking: tensors' memory moved off its device between training phases and brought back in place.

[Note: parking]
DeepSpeed's ``offload_states`` / ``reload_states`` (an RLHF loop generating between training steps) move the
optimizer states, masters, weights off the accelerator and back. Here a storage is parked whole: its bytes are
copied out (to pinned host memory, or to a file on NVMe), then the storage is resized to 0 bytes, which gives the
memory back while every view of it (a tile's master, a parameter's data, the optimizer's state entries) stays the
same Python object. Reloading resizes each storage to its size again and copies the bytes back, so nothing that
holds a view needs to know. A view of a parked storage must not be read (it would read freed memory): the engine
refuses what would use one (StatesOffloadedError), the tier managers and stage 3's shards refuse while flagged
parked, and the model's parameters point at empty placeholders meanwhile. On NVMe, every storage has a 4 KiB-
aligned place in one file per rank and kind, written and read through the AIO handle, and the disk keeps a tenth
free. A park that fails part way brings back what it had moved and removes its file; a reload that fails leaves
what is still away, and its file, for another try.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from infinity.aio.handle import AioHandle, AioSettings
from infinity.errors import ConfigError
from infinity.memory.host import trim_heap
from infinity.memory.plan import INIT_DISK_RESERVE, disk_space, round_up


@dataclass(slots=True)
class _Parked:
    storage: torch.UntypedStorage
    nbytes: int
    offset: int = 0  # in the file (NVMe)
    host: torch.Tensor | None = None  # the bytes (host)
    away: bool = False


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class Parking:
    """One set of parked storages: in host memory (``path`` None) or in a file at ``path``."""

    def __init__(self, tensors: list[torch.Tensor], *, path: str | None, aio: AioSettings | None,
                 pin_memory: bool) -> None:  # fmt: skip
        self.path = path
        self.aio = aio
        self.pin_memory = pin_memory and torch.cuda.is_available()
        self._handle: AioHandle | None = None
        seen: dict[int, _Parked] = {}
        offset = 0
        for tensor in tensors:
            storage = tensor.untyped_storage()
            if storage.nbytes() == 0 or storage.data_ptr() in seen:
                continue  # empty (or parked already), or shared with a tensor already listed
            seen[storage.data_ptr()] = _Parked(storage, storage.nbytes(), offset)
            offset += round_up(storage.nbytes())
        self.parked = list(seen.values())
        self.file_bytes = offset

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parked)

    def storages(self) -> set[int]:
        """The parked storages' addresses, as they were before parking."""
        return {id(item.storage) for item in self.parked}

    def park(self) -> None:
        if self.path is not None and self.parked:
            self._check_room()
            self._handle = AioHandle.from_settings(self.aio or AioSettings())
        try:
            for item in self.parked:
                source = _bytes(item.storage)
                if self.path is None:
                    item.host = torch.empty(item.nbytes, dtype=torch.uint8, pin_memory=self.pin_memory)
                    item.host.copy_(source)
                else:
                    self._handle.sync_pwrite(source, self.path, item.offset)
                item.storage.resize_(0)
                item.away = True
        except BaseException:
            try:
                self._bring_back()
            finally:
                self.discard_file()
            raise
        trim_heap()  # the freed pages go back to the kernel now, not at the heap's next trim

    def reload(self) -> None:
        """Everything back in place; on a failure, what is still away stays away (and its file) for a retry."""
        self._bring_back()
        self.discard_file()

    def _bring_back(self) -> None:
        for item in self.parked:
            if not item.away:
                continue
            item.storage.resize_(item.nbytes)
            target = _bytes(item.storage)
            if self.path is None:
                target.copy_(item.host)
                item.host = None
            else:
                self._handle.sync_pread(target, self.path, item.offset)
            item.away = False

    def discard_file(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None
        if self.path is not None and os.path.exists(self.path):
            os.remove(self.path)

    def _check_room(self) -> None:
        folder = os.path.dirname(self.path)
        disk = disk_space(folder)
        if disk is None:
            raise ConfigError(f"offload_states: the folder {folder!r} does not exist; create it or pass another")
        if disk.free - self.file_bytes < INIT_DISK_RESERVE * disk.size:
            raise ConfigError(
                f"offload_states: parking {self.file_bytes / 2**30:.2f} GiB in {folder} would leave less than a "
                f"tenth of its disk free ({disk.free / 2**30:.1f} GiB free of {disk.size / 2**30:.1f} GiB); free "
                "space there or offload to the host (device='cpu')"
            )
