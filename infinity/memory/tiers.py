"""The tier manager: where each movable segment of training state lives, and how it reaches compute.

[Note: tiers]
A segment is a flat tensor of training state that can move: one optimizer tile's fp32 master and states
(infinity/zero/tiles.py), or one unit's compute-dtype parameter piece (infinity/zero/shards.py). Each has a home tier:
- DEVICE, HOST: the manager owns a tensor for it in device or host memory; acquiring it hands that tensor out,
  nothing moves.
- NVME: it lives in the rank's swap file (NvmeStore). Acquiring it takes a staging buffer from a fixed ring
  of ``buffer_count`` host buffers and reads into it; giving it back dirty writes it out, and the buffer
  returns to the ring when the write has finished. A ring buffer is reused only after its write completed,
  and acquiring a segment whose write is still in flight waits for that write and takes its buffer as it is
  (the bytes are there; no read): so a read never overtakes the write of the same segment.
Callers ``acquire(name)`` a handle, ``wait()`` for its tensor and ``release(handle, dirty=...)`` it; they never
branch on the tier. An NVMe segment has one holder at a time: acquiring it again before its handle is released is
a SegmentHeldError (two handles would be two copies in two ring buffers, and the last one released dirty would
overwrite the other's changes on disk). A DEVICE or HOST segment's handle is its home tensor itself, so any number
may be out at once (a kept parameter piece, a master lent to the user's optimizer for the engine's life).
Every buffer has an owner (the ring) and a budget (buffer_count x the largest segment),
allocated once at open: host memory stays flat across steps. A segment larger than a ring buffer moves with
``read_into`` / ``write_from`` from the caller's own tensor; ``write_from(block=False)`` (a loose write) keeps that
tensor alive until the write lands, and loose writes in flight hold at most the ring's bytes (one write when a
single segment is larger), so the caller's tensors stay within the same budget.

Accounting, per tier and direction: bytes moved, requests, and the seconds the caller was blocked waiting; of
them, those of outsized segments (moved with read_into / write_from, around the ring).
``window()`` gives the totals since the last call, for the per-step report line.
"""

from __future__ import annotations

import enum
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from infinity.aio.buffers import HostBuffer, allocate_host_buffer
from infinity.aio.handle import AioHandle
from infinity.errors import ConfigError, InfinityError, StatesOffloadedError, TierBudgetError
from infinity.memory.nvme_store import NvmeStore, SegmentRequest, _human

logger = logging.getLogger("infinity")


class SegmentHeldError(InfinityError, RuntimeError):
    """An NVMe segment was acquired while a handle on it was still held (a bug in the caller)."""


class Tier(enum.Enum):
    DEVICE = "device"
    HOST = "host"
    NVME = "nvme"


class Residency(enum.Enum):
    RESIDENT = "resident"  # usable in memory now (home HOST, or staged in a ring buffer)
    IN_FLIGHT = "in flight"  # a read or a write is running
    ABSENT = "absent"  # only on NVMe


@dataclass(slots=True)
class Traffic:
    """One tier and direction: bytes moved, requests, seconds a caller was blocked waiting for them."""

    bytes: int = 0
    requests: int = 0
    blocked_s: float = 0.0

    def add(self, other: Traffic) -> None:
        self.bytes += other.bytes
        self.requests += other.requests
        self.blocked_s += other.blocked_s


DIRECTIONS = ("nvme_read", "nvme_write")


@dataclass(slots=True)
class TierStats:
    """Totals per direction, and bytes held per tier."""

    traffic: dict[str, Traffic] = field(default_factory=lambda: {d: Traffic() for d in DIRECTIONS})
    # of the traffic, that of segments larger than a ring buffer (read on demand into the caller's tensor)
    outsized: dict[str, Traffic] = field(default_factory=lambda: {d: Traffic() for d in DIRECTIONS})
    held_bytes: dict[str, int] = field(default_factory=dict)  # tier -> bytes of segments whose home it is
    staging_bytes: int = 0  # the ring of host buffers for NVMe segments

    def as_dict(self) -> dict:
        return {
            "traffic": {d: {"bytes": t.bytes, "requests": t.requests, "blocked_s": t.blocked_s}
                        for d, t in self.traffic.items()},
            "outsized": {d: {"bytes": t.bytes, "requests": t.requests, "blocked_s": t.blocked_s}
                         for d, t in self.outsized.items()},
            "held_bytes": dict(self.held_bytes),
            "staging_bytes": self.staging_bytes,
        }  # fmt: skip


@dataclass(frozen=True, slots=True)
class SegmentSpec:
    name: str
    numel: int
    home: Tier
    dtype: torch.dtype = torch.float32

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


class SegmentHandle:
    """A segment on its way to or in memory: ``wait()`` gives its fp32 tensor (views of a ring buffer for NVMe
    segments, the home tensor for HOST ones)."""

    __slots__ = ("spec", "tensor", "_request", "_slot", "_manager")

    def __init__(self, spec: SegmentSpec, tensor: torch.Tensor, request: SegmentRequest | None, slot, manager):
        self.spec = spec
        self.tensor = tensor
        self._request = request
        self._slot = slot
        self._manager = manager

    @property
    def in_ring(self) -> bool:
        """Its tensor is a staging ring buffer, reused for another segment once this handle is released."""
        return self._slot is not None

    def ready(self) -> bool:
        return self._request is None or self._request.done()

    def wait(self) -> torch.Tensor:
        if self._request is not None:
            self._manager._wait(self._request, "nvme_read", self.spec.nbytes)
            self._request = None
        return self.tensor


@dataclass(eq=False, slots=True)
class _Slot:
    """One ring buffer: free, held by a handle, or writing (``write`` set)."""

    buffer: HostBuffer
    held: bool = False
    write: SegmentRequest | None = None
    write_bytes: int = 0
    writing: str | None = None  # the segment being written from it


class TierManager:
    """Owns the segments' homes, the NVMe staging ring and the accounting ([Note: tiers])."""

    def __init__(
        self,
        *,
        store: NvmeStore | None = None,
        handle: AioHandle | None = None,
        read_handle: AioHandle | None = None,
        buffer_count: int = 4,
        pin_memory: bool = False,
        device: torch.device | None = None,
        owner: str = "offload_optimizer",
    ) -> None:
        if buffer_count < 1:
            raise ConfigError(f"buffer_count must be >= 1, got {buffer_count}")
        self.store = store
        self._handle = handle  # owned: closed with the manager
        self._read_handle = read_handle  # owned too: the store's reads, where they have their own queue
        self.buffer_count = buffer_count
        self.owner = owner  # the config section whose buffer_count sizes the ring, for errors
        self.buffer_bytes: int | None = None  # the ring's buffer size; default (None): the largest NVMe segment
        self.pin_memory = pin_memory
        self.device = device or torch.device("cpu")  # where DEVICE homes live
        self._specs: dict[str, SegmentSpec] = {}
        self._homes: dict[str, torch.Tensor] = {}
        self._ring: list[_Slot] = []
        self._writing: deque[_Slot] = deque()  # in submission order
        self._writing_by_name: dict[str, _Slot] = {}
        self._held: dict[str, SegmentHandle] = {}  # NVMe segments in a ring buffer, by name
        # write_from(block=False): writes not from the ring, each with the tensor it reads from
        self._loose_writes: dict[str, tuple[SegmentRequest, torch.Tensor]] = {}
        # start_read's reads into callers' tensors, until finish_read: a write of the segment waits for its read
        # (reads and writes have their own queues: [Note: reads beside writes] in offload.py)
        self._reads: dict[str, SegmentRequest] = {}
        self._traffic = {d: Traffic() for d in DIRECTIONS}
        self._window = {d: Traffic() for d in DIRECTIONS}
        self._outsized = {d: Traffic() for d in DIRECTIONS}
        self._open = False
        self.parked = False  # offload_states moved the homes' memory away ([Note: parking] in parking.py)

    # ---- setting up ----
    def add(self, name: str, numel: int, home: Tier, dtype: torch.dtype = torch.float32) -> SegmentSpec:
        if self._open:
            raise ConfigError(f"segment {name!r}: segments are added before the tier manager opens")
        if home is Tier.NVME and self.store is None:
            raise ConfigError(f"segment {name!r} has home NVMe but the tier manager has no swap store")
        spec = SegmentSpec(name, numel, home, dtype)
        self._specs[name] = spec
        if home is Tier.NVME:
            self.store.add(name, spec.nbytes)
        return spec

    def open(self) -> None:
        """Opens the swap store and allocates the homes and the ring; then ``initialize`` each segment."""
        nvme = [s for s in self._specs.values() if s.home is Tier.NVME]
        pin = self.pin_memory and torch.cuda.is_available()
        if nvme:
            if self.buffer_bytes is None:
                self.buffer_bytes = max(s.nbytes for s in nvme)
            self.store.open()
            for _ in range(self.buffer_count):
                self._ring.append(_Slot(allocate_host_buffer(self.buffer_bytes, pin=pin)))
        for spec in self._specs.values():
            if spec.home is Tier.HOST:
                self._homes[spec.name] = torch.empty(spec.numel, dtype=spec.dtype, pin_memory=pin)  # pinned as made
            elif spec.home is Tier.DEVICE:
                self._homes[spec.name] = torch.empty(spec.numel, dtype=spec.dtype, device=self.device)
        self._open = True

    def home_tensors(self, tiers: set[Tier]) -> list[torch.Tensor]:
        """The home tensors of the segments whose home is in ``tiers`` (offload_states parks them)."""
        return [self._homes[name] for name, spec in self._specs.items() if spec.home in tiers and name in self._homes]

    def initialize(self, name: str, fill: Callable[[torch.Tensor], None]) -> None:
        """The segment's first value: ``fill(tensor)`` writes it (NVMe: into a ring buffer, written out at once,
        so no more than the ring is ever in host memory)."""
        handle = self.acquire(name, read=False)
        fill(handle.tensor)
        self.release(handle, dirty=True)

    def fits(self, name: str) -> bool:
        """Whether the segment fits a ring buffer (larger ones move only with read_into / write_from)."""
        spec = self._specs[name]
        return spec.home is not Tier.NVME or spec.nbytes <= (self.buffer_bytes or 0)

    # ---- moving ----
    def acquire(self, name: str, *, block: bool = True, read: bool = True) -> SegmentHandle | None:
        """A handle on segment ``name``. NVMe: a ring buffer and (``read``) a read into it; without ``block``,
        None when no buffer is free right now; acquiring one already held is an error (a second buffer: one of
        the two's writes would be lost). A home segment (host or device) is its home tensor, which every handle
        on it views, so holding it twice is one buffer and allowed."""
        if self.parked:
            raise StatesOffloadedError(f"{self.owner}: its states are away (engine.offload_states); call "
                                       "engine.reload_states() first")  # fmt: skip
        spec = self._specs[name]
        if spec.home is not Tier.NVME:
            return SegmentHandle(spec, self._homes[name], None, None, self)
        self._check_not_held(name, "acquiring it again")
        self._after_read(name)
        self.reap_loose_writes()
        if name in self._loose_writes:
            self.settle(name)
        pending = self._writing_by_name.get(name)
        if pending is not None:  # its newest bytes are in that buffer: take it back once written
            self._writing.remove(pending)
            self._finish_write(pending)
            pending.held = True
            handle = SegmentHandle(spec, pending.buffer.view(spec.numel, spec.dtype), None, pending, self)
            self._held[name] = handle
            return handle
        slot = self._free_slot(block=block)
        if slot is None:
            return None
        tensor = slot.buffer.view(spec.numel, spec.dtype)
        request = self.store.read(name, tensor) if read else None  # a missing or short file raises: slot stays free
        slot.held = True
        handle = SegmentHandle(spec, tensor, request, slot, self)
        self._held[name] = handle
        return handle

    def release(self, handle: SegmentHandle, *, dirty: bool) -> None:
        """Done with the segment: NVMe segments that changed are written back (asynchronously)."""
        slot = handle._slot
        if slot is None:
            return
        try:
            handle.wait()  # a read still in flight must land before its buffer is reused
        finally:
            slot.held = False
            handle._slot = None
            if self._held.get(handle.spec.name) is handle:
                del self._held[handle.spec.name]
        if dirty:
            slot.write = self.store.write(handle.spec.name, handle.tensor)
            slot.write_bytes = handle.spec.nbytes
            slot.writing = handle.spec.name
            self._writing_by_name[handle.spec.name] = slot
            self._writing.append(slot)

    def all_held(self) -> bool:
        """Whether every ring buffer is held by a handle (none free, none only writing)."""
        return bool(self._ring) and all(slot.held for slot in self._ring)

    def being_written(self, name: str) -> torch.Tensor | None:
        """The segment's newest bytes where a write from a ring buffer is still taking them to NVMe: read them from
        there (no read, no wait), before anything else acquires a buffer. None where no such write is in flight."""
        slot = self._writing_by_name.get(name)
        if slot is None:
            return None
        spec = self._specs[name]
        return slot.buffer.view(spec.numel, spec.dtype)

    def read_into(self, name: str, out: torch.Tensor) -> None:
        """Blocking read of an NVMe segment straight into ``out`` (any tensor of its size, e.g. on the device)."""
        self.finish_read(name, self.start_read(name, out))

    def start_read(self, name: str, out: torch.Tensor) -> SegmentRequest:
        """Starts reading an NVMe segment straight into ``out``, which the caller keeps untouched until
        ``finish_read(name, request)``."""
        self._check_not_held(name, "reading it")
        self.reap_loose_writes()
        self.settle(name)
        request = self.store.read(name, out)
        self._reads[name] = request
        return request

    def finish_read(self, name: str, request: SegmentRequest) -> None:
        """Waits for a read ``start_read`` began (a failed one raises here), counted in the traffic."""
        if self._reads.get(name) is request:
            del self._reads[name]
        self._wait(request, "nvme_read", self._specs[name].nbytes, outsized=not self.fits(name))

    def write_from(self, name: str, values: torch.Tensor, *, block: bool = True) -> None:
        """Write of ``values`` into an NVMe segment. Without ``block`` it runs behind the caller (a loose write),
        who must not change ``values`` until ``settle(name)`` or ``flush()`` (a later read or write of the segment
        waits); loose writes in flight hold at most the ring's bytes (or one write), the oldest waited for first."""
        spec = self._specs[name]
        self._check_not_held(name, "writing it")
        self._after_read(name)
        self.settle(name)
        self.reap_loose_writes()
        values = values.contiguous()
        if not block:
            budget = self.buffer_count * (self.buffer_bytes or 0)
            while self._loose_writes and self._loose_bytes() + spec.nbytes > budget:
                self.settle(next(iter(self._loose_writes)))
        request = self.store.write(name, values)
        if block:
            self._wait(request, "nvme_write", spec.nbytes, outsized=not self.fits(name))
        else:
            self._loose_writes[name] = (request, values)  # values kept alive until it lands

    def _check_not_held(self, name: str, doing: str) -> None:
        if name in self._held:
            raise SegmentHeldError(
                f"NVMe segment {name!r} of {self.owner} is held (acquired, not released): release its handle before "
                f"{doing}; two copies of one segment would overwrite each other's changes"
            )

    def _after_read(self, name: str) -> None:
        """Waits for a start_read of the segment still in flight (its failure is finish_read's to raise): a write
        must not land before it, and a ring buffer read must not race it."""
        request = self._reads.get(name)
        if request is not None and not request.done():
            request.exception()

    def _loose_bytes(self) -> int:
        return sum(self._specs[name].nbytes for name in self._loose_writes)

    def writing(self, name: str) -> bool:
        """Whether a write of the segment is still in flight (as of the last reap_loose_writes)."""
        return name in self._loose_writes or name in self._writing_by_name

    def reap_loose_writes(self) -> None:
        """Finishes the loose writes that are done: their tensors are freed, a failed one raises now."""
        for name in [n for n, (request, _) in self._loose_writes.items() if request.done()]:
            self.settle(name)

    def settle(self, name: str) -> None:
        """Waits for the segment's write in flight, if any."""
        pending = self._writing_by_name.get(name)
        if pending is not None:
            self._writing.remove(pending)
            self._finish_write(pending)
        loose = self._loose_writes.pop(name, None)
        if loose is not None:
            self._wait(loose[0], "nvme_write", self._specs[name].nbytes, outsized=not self.fits(name))

    def flush(self) -> None:
        """Waits for every write in flight."""
        while self._writing:
            self._finish_write(self._writing.popleft())
        for name in list(self._loose_writes):
            self.settle(name)

    def _free_slot(self, *, block: bool) -> _Slot | None:
        for slot in self._ring:
            if not slot.held and slot.write is None:
                return slot
        while self._writing:
            oldest = self._writing[0]
            if not block and not oldest.write.done():
                return None
            self._finish_write(self._writing.popleft())
            if not oldest.held:
                return oldest
        if not block:
            return None
        raise TierBudgetError(
            f"all {len(self._ring)} NVMe staging buffers of {self.owner} are held at once; raise "
            f"{self.owner}.buffer_count"
        )

    def _finish_write(self, slot: _Slot) -> None:
        request, slot.write = slot.write, None
        self._writing_by_name.pop(slot.writing, None)
        slot.writing = None
        self._wait(request, "nvme_write", slot.write_bytes)

    def _wait(self, request: SegmentRequest, direction: str, nbytes: int, *, outsized: bool = False) -> None:
        start = time.perf_counter()
        request.wait()
        moved = Traffic(nbytes, 1, time.perf_counter() - start)
        self._traffic[direction].add(moved)
        self._window[direction].add(moved)
        if outsized:
            self._outsized[direction].add(moved)

    def residency(self, name: str) -> Residency:
        """Where the segment's newest bytes are: in memory (RESIDENT), moving (IN_FLIGHT), or only on NVMe."""
        if self._specs[name].home is not Tier.NVME:
            return Residency.RESIDENT
        held = self._held.get(name)
        if held is not None:
            return Residency.RESIDENT if held.ready() else Residency.IN_FLIGHT
        in_flight = name in self._writing_by_name or name in self._loose_writes
        return Residency.IN_FLIGHT if in_flight else Residency.ABSENT

    # ---- accounting ----
    def stats(self) -> TierStats:
        held: dict[str, int] = {}
        for spec in self._specs.values():
            held[spec.home.value] = held.get(spec.home.value, 0) + spec.nbytes
        return TierStats(
            traffic={d: Traffic(t.bytes, t.requests, t.blocked_s) for d, t in self._traffic.items()},
            outsized={d: Traffic(t.bytes, t.requests, t.blocked_s) for d, t in self._outsized.items()},
            held_bytes=held,
            staging_bytes=sum(slot.buffer.nbytes for slot in self._ring),
        )

    def window(self) -> dict[str, Traffic]:
        """Traffic since the last call."""
        window, self._window = self._window, {d: Traffic() for d in DIRECTIONS}
        return window

    def describe(self) -> str:
        stats = self.stats()
        parts = [f"{tier} {_human(n)}" for tier, n in sorted(stats.held_bytes.items())]
        if stats.staging_bytes:
            parts.append(f"NVMe staging ring {len(self._ring)} x {_human(stats.staging_bytes // len(self._ring))}")
        return ", ".join(parts)

    # ---- teardown ----
    def close(self) -> None:
        """Finishes the writes in flight, removes the swap files, frees the ring. Idempotent."""
        try:
            if self._open:
                self.flush()
        finally:
            self._open = False
            self._writing.clear()
            self._writing_by_name.clear()
            self._loose_writes.clear()
            self._reads.clear()
            self._held.clear()
            for slot in self._ring:
                slot.buffer.release()
            self._ring.clear()
            self._homes.clear()
            if self.store is not None:
                self.store.close()
            handle, read_handle, self._handle, self._read_handle = self._handle, self._read_handle, None, None
            try:
                if handle is not None:
                    handle.close()
            finally:
                if read_handle is not None:
                    read_handle.close()
