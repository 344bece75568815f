"""How long the disk under a folder was busy, from the kernel's own counter (io_ticks in
/sys/dev/block/<major>:<minor>/stat, milliseconds with at least one request in flight). With the seconds the
training loop was blocked on I/O it says how much of the I/O ran hidden behind compute. The counter covers the
whole device: other processes' I/O counts too, so on a shared disk the figure is an upper bound. DiskPhases splits
the same counters, and the bytes the device moved, by the phases of each step."""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass

from infinity.train.medians import steady_medians


def stat_path(folder: str) -> str | None:
    try:
        device = os.stat(folder).st_dev
    except OSError:
        return None
    path = f"/sys/dev/block/{os.major(device)}:{os.minor(device)}/stat"
    return path if os.path.exists(path) else None  # tmpfs, overlay and the like have no block device


def _io_ticks_s(path: str) -> float | None:
    counters = _counters(path)
    return None if counters is None else counters[2] / 1000.0


class DiskBusy:
    """Seconds the disk holding ``folder`` was busy since this object was made (None where unknown)."""

    def __init__(self, folder: str | None) -> None:
        self._path = stat_path(folder) if folder else None
        self._start = _io_ticks_s(self._path) if self._path else None

    def seconds(self) -> float | None:
        if self._start is None or self._path is None:
            return None
        now = _io_ticks_s(self._path)
        return None if now is None else now - self._start


PHASES = ("forward", "backward", "step")  # the training loop's calls: engine(...), engine.backward, engine.step
SECTOR_BYTES = 512  # the unit of the stat file's sector counts, whatever the device's own sector size


@dataclass(kw_only=True, slots=True)
class PhaseTraffic:
    """One phase of a step, as the disk saw it: wall time, bytes the device read and wrote, seconds it was busy."""

    wall_s: float = 0.0
    read_bytes: float = 0  # a median over an even number of steps may fall between two counts
    written_bytes: float = 0
    busy_s: float = 0.0


def _counters(path: str) -> tuple[int, int, int] | None:
    """(bytes read, bytes written, busy milliseconds) since boot, from the device's stat file."""
    try:
        with open(path) as f:
            fields = f.read().split()
        return int(fields[2]) * SECTOR_BYTES, int(fields[6]) * SECTOR_BYTES, int(fields[9])
    except (OSError, IndexError, ValueError):
        return None


class DiskPhases:
    """What the disk holding ``folder`` did in each phase of each step: where a step is slower than its disk, this
    says whether the disk idled in the forward or the backward (with the optimizer on NVMe the step runs behind
    the forward, whose time and traffic then include it). The counters are the device's (or the partition's)
    holding the folder, as DiskBusy's: other processes' I/O on it counts too."""

    def __init__(self, folder: str | None) -> None:
        self._path = stat_path(folder) if folder else None
        self.steps: list[dict[str, PhaseTraffic]] = []

    def begin_step(self) -> None:
        if self._path is not None:
            self.steps.append({phase: PhaseTraffic() for phase in PHASES})

    @contextlib.contextmanager
    def phase(self, name: str):
        """Counts what the disk does while the block runs into ``name`` (one of PHASES) of the current step;
        before the first ``begin_step`` (or without a block device) nothing is counted."""
        if name not in PHASES:
            raise ValueError(f"DiskPhases.phase: {name!r} is not one of {PHASES}")
        before = _counters(self._path) if self._path is not None and self.steps else None
        started = time.perf_counter()
        try:
            yield
        finally:
            after = _counters(self._path) if before is not None else None
            if after is not None:
                traffic = self.steps[-1][name]
                traffic.wall_s += time.perf_counter() - started
                traffic.read_bytes += after[0] - before[0]
                traffic.written_bytes += after[1] - before[1]
                traffic.busy_s += (after[2] - before[2]) / 1000.0

    def medians(self) -> dict[str, PhaseTraffic] | None:
        """Per phase, each figure's median over the steps after the first (the first step's alone if it is the
        only one); None where the folder has no block device or no step ran."""
        if not self.steps:
            return None
        return {phase: steady_medians([step[phase] for step in self.steps]) for phase in PHASES}
