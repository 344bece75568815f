"""How long the disk under a folder was busy, from the kernel's own counter (io_ticks in
/sys/dev/block/<major>:<minor>/stat, milliseconds with at least one request in flight). With the seconds the
training loop was blocked on I/O it says how much of the I/O ran hidden behind compute. The counter covers the
whole device: other processes' I/O counts too, so on a shared disk the figure is an upper bound."""

from __future__ import annotations

import os


def _stat_path(folder: str) -> str | None:
    try:
        device = os.stat(folder).st_dev
    except OSError:
        return None
    path = f"/sys/dev/block/{os.major(device)}:{os.minor(device)}/stat"
    return path if os.path.exists(path) else None  # tmpfs, overlay and the like have no block device


def _io_ticks_s(path: str) -> float | None:
    try:
        with open(path) as f:
            fields = f.read().split()
        return int(fields[9]) / 1000.0
    except (OSError, IndexError, ValueError):
        return None


class DiskBusy:
    """Seconds the disk holding ``folder`` was busy since this object was made (None where unknown)."""

    def __init__(self, folder: str | None) -> None:
        self._path = _stat_path(folder) if folder else None
        self._start = _io_ticks_s(self._path) if self._path else None

    def seconds(self) -> float | None:
        if self._start is None or self._path is None:
            return None
        now = _io_ticks_s(self._path)
        return None if now is None else now - self._start
