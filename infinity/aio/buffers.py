"""Aligned host buffers for direct I/O, and a bounded pool of them.

Why huge pages: every 4 KiB page of a buffer is a separate segment of a direct-I/O request, and on the
disks this was measured on that halves O_DIRECT throughput (docs/ARCHITECTURE.md, "Measured"). A buffer
that is 2 MiB-aligned and backed by huge pages moves in a few large segments. So every buffer the I/O
engine touches comes from here or is staged through one.

Lifetimes: a buffer's memory is an anonymous mmap that the returned tensors keep alive (torch.frombuffer
holds a reference), so "releasing" a buffer drops its lock/pin and its place in a budget; the mapping
goes away when the last tensor viewing it is gone. Nothing here ever unmaps memory a tensor still uses.
"""

from __future__ import annotations

import ctypes
import enum
import logging
import mmap
import os
import threading
import warnings
from dataclasses import dataclass, field

import torch

from infinity.errors import ConfigError, TierBudgetError

logger = logging.getLogger(__name__)

HUGE_PAGE_BYTES = 2 << 20
IO_ALIGNMENT = 4096
_MAP_HUGETLB = getattr(mmap, "MAP_HUGETLB", 0x40000)  # Linux x86/arm value; Python < 3.12 lacks it


class Backing(enum.Enum):
    """What backs a buffer's pages."""

    HUGETLB = "hugetlb"
    """Reserved huge pages (vm.nr_hugepages): always 2 MiB, never split."""
    TRANSPARENT_HUGE = "thp"
    """Ordinary anonymous memory advised MADV_HUGEPAGE; the kernel backs it with huge pages when it can."""
    PAGES = "pages"
    """Ordinary 4 KiB pages (huge pages were not asked for)."""


class HugePagePolicy(enum.Enum):
    AUTO = "auto"
    """hugetlb when enough reserved pages are free, else transparent huge pages."""
    HUGETLB = "hugetlb"
    TRANSPARENT = "thp"
    NONE = "none"


@dataclass(eq=False)
class HostBuffer:
    """One aligned host allocation. ``data`` is a flat uint8 tensor of exactly ``nbytes``."""

    data: torch.Tensor  # (nbytes,) uint8, address 2 MiB-aligned
    nbytes: int
    backing: Backing
    locked: bool  # mlock()ed: never swapped out
    pinned: bool  # registered with CUDA as page-locked host memory
    _mapping: mmap.mmap = field(repr=False)
    _released: bool = field(default=False, repr=False)

    @property
    def address(self) -> int:
        return self.data.data_ptr()

    def view(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """The first ``numel`` elements of the buffer as a 1-D tensor of ``dtype`` (no copy)."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        if numel * itemsize > self.nbytes:
            raise TierBudgetError(
                f"a view of {numel} x {dtype} ({numel * itemsize} bytes) does not fit this "
                f"{self.nbytes}-byte host buffer"
            )
        return self.data[: numel * itemsize].view(dtype)

    def release(self) -> None:
        """Unlock/unpin and drop the mapping reference. Safe to call twice."""
        if self._released:
            return
        self._released = True
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.address)
        elif self.locked:
            _libc().munlock(ctypes.c_void_p(self.address), ctypes.c_size_t(self.nbytes))
        self.pinned = self.locked = False


_lock_warning_lock = threading.Lock()
_lock_warning_given = False


def _warn_unlocked_once(nbytes: int, err: int) -> None:
    global _lock_warning_given
    with _lock_warning_lock:
        if _lock_warning_given:
            return
        _lock_warning_given = True
    limit = _memlock_limit_text()
    warnings.warn(
        f"could not lock {nbytes} bytes of host I/O buffers in memory ({os.strerror(err)}; memlock limit "
        f"{limit}). Continuing with unlocked buffers: I/O is unchanged, but the kernel may swap them. "
        "Raise the limit (ulimit -l, or LimitMEMLOCK for a service) to lock them.",
        ResourceWarning,
        stacklevel=4,
    )


def _memlock_limit_text() -> str:
    import resource

    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return "unlimited" if soft == resource.RLIM_INFINITY else f"{soft} bytes"


_LIBC: ctypes.CDLL | None = None


def _libc() -> ctypes.CDLL:
    global _LIBC
    if _LIBC is None:
        _LIBC = ctypes.CDLL(None, use_errno=True)
    return _LIBC


def free_hugetlb_bytes() -> int:
    """Bytes of reserved (hugetlb) 2 MiB pages free right now."""
    free_pages = 0
    page_kib = 0
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("HugePages_Free:"):
                free_pages = int(line.split()[1])
            elif line.startswith("Hugepagesize:"):
                page_kib = int(line.split()[1])
    return free_pages * page_kib * 1024 if page_kib * 1024 == HUGE_PAGE_BYTES else 0


def available_host_bytes() -> int:
    """What can be allocated without swapping: MemAvailable from /proc/meminfo, or less where the process's memory
    cgroup (a container's limit) leaves less. Every size planned from host memory reads it here (through
    infinity/memory/plan.py, which shares it among a node's ranks)."""
    available = 0
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
                break
    room = cgroup_room()
    return available if room is None else min(available, room)


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max" (cgroup v2): no limit


def _stat(path: str, key: str) -> int:
    try:
        with open(path) as f:
            for line in f:
                name, _, value = line.partition(" ")
                if name == key:
                    return int(value)
    except (OSError, ValueError):
        pass
    return 0


def cgroup_room(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> int | None:
    """Bytes the process's memory cgroup and its ancestors still allow (limit - usage + the inactive page cache,
    which the kernel reclaims before it counts against the limit), the tightest of them; None without a limit.
    cgroup v2 (memory.max, memory.current) and v1 (the memory controller's limit_in_bytes, usage_in_bytes)."""
    try:
        with open(proc_cgroup) as f:
            entries = [line.strip().split(":", 2) for line in f if line.count(":") >= 2]
    except OSError:
        return None
    layouts = []  # (folder of the process's cgroup, its mount, limit file, usage file, stat key)
    for _, controllers, path in entries:
        if controllers == "":
            layouts.append((root, path, "memory.max", "memory.current", "inactive_file"))
        elif "memory" in controllers.split(","):
            layouts.append((os.path.join(root, "memory"), path, "memory.limit_in_bytes", "memory.usage_in_bytes",
                            "total_inactive_file"))  # fmt: skip
    rooms = []
    for mount, path, limit_file, usage_file, cache_key in layouts:
        folder = os.path.join(mount, path.lstrip("/"))
        if not os.path.isdir(folder):  # a container sees its own cgroup as the mount's root
            folder = mount
        while True:
            limit = _read_int(os.path.join(folder, limit_file))
            usage = _read_int(os.path.join(folder, usage_file))
            if limit is not None and usage is not None and limit < 1 << 60:  # v1 writes "no limit" as ~2^63
                rooms.append(max(limit - usage + _stat(os.path.join(folder, "memory.stat"), cache_key), 0))
            if os.path.normpath(folder) == os.path.normpath(mount):
                break
            folder = os.path.dirname(folder)
    return min(rooms) if rooms else None


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


def _map_hugetlb(nbytes: int) -> mmap.mmap | None:
    try:
        return mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_HUGETLB)
    except OSError:
        return None


def allocate_host_buffer(
    nbytes: int,
    *,
    huge_pages: HugePagePolicy | str = HugePagePolicy.AUTO,
    lock: bool = True,
    pin: bool | None = None,
) -> HostBuffer:
    """Allocate ``nbytes`` of 2 MiB-aligned host memory for direct I/O.

    pin: register with CUDA as page-locked (None: when CUDA is available). Without pinning, ``lock``
    mlocks the buffer when the memlock limit allows, else it stays unlocked with one warning.
    """
    policy = HugePagePolicy(huge_pages)
    if nbytes < 0:
        raise ConfigError(f"host buffer size must be >= 0 bytes, got {nbytes}")
    if nbytes > available_host_bytes():
        raise TierBudgetError(
            f"a host buffer of {nbytes} bytes exceeds the host memory available now "
            f"({available_host_bytes()} bytes, MemAvailable); lower the buffer count or size"
        )
    size = _round_up(max(nbytes, 1), HUGE_PAGE_BYTES)

    mapping = None
    backing = Backing.PAGES
    start = 0
    if policy in (HugePagePolicy.AUTO, HugePagePolicy.HUGETLB) and (
        policy is HugePagePolicy.HUGETLB or free_hugetlb_bytes() >= size
    ):
        mapping = _map_hugetlb(size)  # hugetlb mappings are 2 MiB-aligned by construction
        if mapping is not None:
            backing = Backing.HUGETLB
    if mapping is None:
        # Over-allocate by one huge page and slice at the first 2 MiB boundary. MAP_PRIVATE matters:
        # a shared anonymous mapping is shmem, where THP is usually off.
        mapping = mmap.mmap(-1, size + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if policy is not HugePagePolicy.NONE and hasattr(mmap, "MADV_HUGEPAGE"):
            mapping.madvise(mmap.MADV_HUGEPAGE)  # before first touch, or the pages are already small
            backing = Backing.TRANSPARENT_HUGE
    whole = torch.frombuffer(mapping, dtype=torch.uint8)
    if backing is not Backing.HUGETLB:
        start = (-whole.data_ptr()) % HUGE_PAGE_BYTES
    data = whole[start : start + nbytes]
    del whole

    pinned = locked = False
    if pin and not torch.cuda.is_available():
        raise ConfigError("pin_memory=True needs CUDA, which is not available; use pin_memory=false on CPU")
    want_pin = torch.cuda.is_available() if pin is None else pin
    if want_pin and nbytes:
        # cudaHostRegister faults the pages in and page-locks them for DMA.
        err = torch.cuda.cudart().cudaHostRegister(data.data_ptr(), nbytes, 0)
        pinned = int(err) == 0
        if not pinned:
            logger.warning("cudaHostRegister of %d bytes failed (%s); buffer is not pinned", nbytes, err)
    if not pinned and lock and nbytes:
        libc = _libc()
        if libc.mlock(ctypes.c_void_p(data.data_ptr()), ctypes.c_size_t(nbytes)) == 0:
            locked = True  # mlock also faults every page in
        else:
            _warn_unlocked_once(nbytes, ctypes.get_errno())
    if not (pinned or locked):
        data.zero_()  # first touch now, so huge pages are taken here and not during timed I/O
    return HostBuffer(data=data, nbytes=nbytes, backing=backing, locked=locked, pinned=pinned, _mapping=mapping)


def anon_huge_page_bytes(buffer: HostBuffer) -> int:
    """Bytes of the buffer's mapping backed by huge pages, from /proc/self/smaps (for reports and tests)."""
    if buffer.backing is Backing.HUGETLB:
        return buffer.nbytes
    address = buffer.address
    in_vma = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(" ", 1)[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                in_vma = lo <= address < hi
            elif in_vma and line.startswith("AnonHugePages:"):
                return int(line.split()[1]) * 1024
    return 0


class HostBufferPool:
    """A bounded set of reusable host buffers: acquire() never exceeds ``budget_bytes`` in total.

    Buffers are reused best-fit; a request that cannot fit after reuse raises TierBudgetError
    naming the budget, so callers size their buffers from the model, not from a magic number.
    """

    def __init__(self, budget_bytes: int, **allocate_kwargs) -> None:
        if budget_bytes <= 0:
            raise ConfigError(f"host buffer pool budget must be > 0 bytes, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self._allocate_kwargs = allocate_kwargs
        self._free: list[HostBuffer] = []
        self._in_use: set[int] = set()
        self._all: list[HostBuffer] = []
        self._lock = threading.Lock()

    @property
    def allocated_bytes(self) -> int:
        return sum(b.nbytes for b in self._all)

    def acquire(self, nbytes: int) -> HostBuffer:
        with self._lock:
            fits = [b for b in self._free if b.nbytes >= nbytes]
            if fits:
                best = min(fits, key=lambda b: b.nbytes)
                self._free.remove(best)
                self._in_use.add(id(best))
                return best
            while self._free and self.allocated_bytes + nbytes > self.budget_bytes:
                victim = self._free.pop()
                self._all.remove(victim)
                victim.release()
            if self.allocated_bytes + nbytes > self.budget_bytes:
                raise TierBudgetError(
                    f"host buffer pool: {nbytes} more bytes would exceed its budget of {self.budget_bytes} "
                    f"bytes ({self.allocated_bytes} allocated, {len(self._in_use)} buffers in use); "
                    "release buffers first or raise the budget"
                )
            buffer = allocate_host_buffer(nbytes, **self._allocate_kwargs)
            self._all.append(buffer)
            self._in_use.add(id(buffer))
            return buffer

    def release(self, buffer: HostBuffer) -> None:
        with self._lock:
            if id(buffer) not in self._in_use:
                raise ValueError("this buffer was not acquired from this pool, or was released twice")
            self._in_use.remove(id(buffer))
            self._free.append(buffer)

    def close(self) -> None:
        with self._lock:
            for buffer in self._all:
                buffer.release()
            self._all.clear()
            self._free.clear()
            self._in_use.clear()
