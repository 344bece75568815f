"""NvmeStore: the per-rank swap store of the NVMe tier.

A store holds named segments (later: parameter shards and optimizer tiles) in files under ``nvme_path``
and moves them to and from tensors through an AioHandle: the layout of segments in one swap file, free-space
check and preallocation at open, size checks before each read. Where the file lives, its lock, and its removal
(at close, at exit, on SIGINT/SIGTERM, and what a crashed run left behind) are swap_lock.py's.

Why one file per rank, not one per segment: a rank may hold thousands of segments (one per optimizer
tile or parameter shard). One file means one open file held for the store's life (no fight with a
1024-descriptor limit), one free-space check, one preallocation, one create and one unlink. What it
costs: the layout is fixed at open (the engine knows every shard's size before training starts), and a
truncation hits every segment past the cut; the size check before each read compares the whole file
with the size it was given at open, so any truncation fails every read, naming the file.

Layout: segments in the order they were added, each at a 4 KiB-aligned offset, each padded to a 4 KiB
multiple. The handle uses O_DIRECT only at an aligned offset (at an unaligned one it silently moves the
whole request with buffered pread/pwrite), so every segment's 4 KiB multiples move with direct I/O. The
handle writes exactly the logical bytes: a segment whose size is not a multiple of 4 KiB has its last
partial page (under 4 KiB) moved with pread/pwrite, and a segment under 4 KiB entirely so. The padding
is never written; it keeps the next segment aligned.

The swap file is opened once, at open (an AioFile: an O_DIRECT descriptor where the filesystem allows and a
buffered one for the unaligned pieces, as a path request would open), and every segment request borrows it:
no open or close per request. Because a descriptor keeps working after its path is unlinked or replaced,
each read first compares the path with the open file (see _check_swap_file), so a deleted, replaced or
truncated swap file still fails the read, naming it.

See [Note: swap folder lock] in swap_lock.py for how runs keep apart and how a crashed run's files are found.

Checksums (``checksum=True``, off by default): zlib.crc32 of each segment's bytes, computed on the
caller's thread when a write is submitted and verified when a read is waited for. Cost: crc32 runs at
about 3 GiB/s on one core of the development machine, as fast as the disk itself, so it can halve swap
throughput; a tensor on a GPU is also copied to the host for it. Use it to chase suspected corruption.
"""

from __future__ import annotations

import ctypes
import errno as errno_module
import itertools
import os
import re
import tempfile
import threading
import time
import weakref
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

from infinity.aio.buffers import IO_ALIGNMENT
from infinity.aio.files import open_file
from infinity.aio.handle import AioHandle
from infinity.aio.request import AioRequest
from infinity.errors import (
    AioError,
    ConfigError,
    InfinityError,
    InvalidTensorError,
    ShortTransferError,
    TierBudgetError,
)
from infinity.memory.swap_lock import SwapFolder, check_nvme_path, remove_stale_folders

_RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")


def _round_up(nbytes: int) -> int:
    return -(-nbytes // IO_ALIGNMENT) * IO_ALIGNMENT


def _human(nbytes: int) -> str:
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} bytes"


# ---- layout ----
@dataclass(frozen=True, slots=True)
class Segment:
    """One named region of the swap file: ``nbytes`` logical bytes at ``offset`` (a 4 KiB multiple),
    occupying ``padded_nbytes`` (the next 4 KiB multiple) so the following segment stays aligned."""

    name: str
    offset: int
    nbytes: int

    @property
    def padded_nbytes(self) -> int:
        return _round_up(self.nbytes)

    @property
    def end(self) -> int:
        return self.offset + self.padded_nbytes


@dataclass(frozen=True)
class SwapLayout:
    """Where each segment lives in the swap file. Build it with ``SwapLayout.from_sizes``."""

    segments: tuple[Segment, ...]
    _index: dict[str, Segment] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        index: dict[str, Segment] = {}
        end = 0
        for segment in self.segments:
            if segment.name in index:
                raise ConfigError(f"swap segment {segment.name!r} is given twice; segment names must be unique")
            if segment.offset % IO_ALIGNMENT or segment.offset < end:
                raise ConfigError(
                    f"swap segment {segment.name!r} at offset {segment.offset} is not 4 KiB-aligned or overlaps "
                    "the one before it; build layouts with SwapLayout.from_sizes"
                )
            index[segment.name] = segment
            end = segment.end
        object.__setattr__(self, "_index", index)

    @classmethod
    def from_sizes(cls, sizes: Iterable[tuple[str, int]]) -> SwapLayout:
        """Segments in the given order, each at the next 4 KiB boundary, padded to 4 KiB."""
        segments = []
        offset = 0
        for name, nbytes in sizes:
            _check_segment(name, nbytes)
            segments.append(Segment(name, offset, nbytes))
            offset += _round_up(nbytes)
        return cls(tuple(segments))

    @property
    def total_bytes(self) -> int:
        """The swap file's size: the end of the last segment's padding."""
        return self.segments[-1].end if self.segments else 0

    def __getitem__(self, name: str) -> Segment:
        return self._index[name]

    def __contains__(self, name: object) -> bool:
        return name in self._index

    def __iter__(self) -> Iterator[Segment]:
        return iter(self.segments)

    def __len__(self) -> int:
        return len(self.segments)


def _check_segment(name: object, nbytes: object) -> None:
    if not isinstance(name, str) or not name:
        raise ConfigError(f"a swap segment's name must be a non-empty string, got {name!r}")
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise ConfigError(f"swap segment {name!r}: nbytes must be a non-negative integer, got {nbytes!r}")


# ---- accounting ----
@dataclass(slots=True)
class DirectionStats:
    """One direction's totals: bytes moved by requests that succeeded, how many, and the seconds callers
    spent blocked in wait() (time the I/O did not overlap with anything else)."""

    bytes: int = 0
    requests: int = 0
    wait_s: float = 0.0


@dataclass(slots=True)
class StoreStats:
    """A snapshot of a store's byte accounting (``NvmeStore.stats``)."""

    read: DirectionStats = field(default_factory=DirectionStats)
    write: DirectionStats = field(default_factory=DirectionStats)


class _Accounting:
    """The live counters behind StoreStats; requests complete on any thread, hence the lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stats = StoreStats()

    def add_wait(self, op: str, seconds: float) -> None:
        with self._lock:
            getattr(self._stats, op).wait_s += seconds

    def add_done(self, op: str, nbytes: int) -> None:
        with self._lock:
            direction = getattr(self._stats, op)
            direction.bytes += nbytes
            direction.requests += 1

    def snapshot(self) -> StoreStats:
        with self._lock:
            return StoreStats(
                read=DirectionStats(self._stats.read.bytes, self._stats.read.requests, self._stats.read.wait_s),
                write=DirectionStats(self._stats.write.bytes, self._stats.write.requests, self._stats.write.wait_s),
            )


# ---- requests ----
def _crc32(tensor: torch.Tensor) -> int:
    flat = tensor.detach().reshape(-1)
    flat = flat if flat.dtype is torch.uint8 else flat.view(torch.uint8)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    return zlib.crc32(memoryview(flat.numpy()))


class SegmentRequest:
    """One queued read or write of a segment: an AioRequest (same ``wait`` / ``done`` / ``exception``,
    ``op``, ``path``, ``offset``, ``nbytes``) that also does the store's bookkeeping when it is waited for:
    byte and wait-time accounting, and with checksums on, verifying a read (a mismatch is an AioError
    naming the segment and the file). Wait through this object, not only through ``AioHandle.wait()``,
    or that bookkeeping is skipped."""

    __slots__ = ("segment", "_request", "_accounting", "_tensor", "_crc", "_checksums", "_lock", "_settled", "_error")

    def __init__(
        self,
        *,
        segment: Segment,
        request: AioRequest,
        accounting: _Accounting,
        tensor: torch.Tensor,
        crc: int | None,
        checksums: dict[str, int] | None,
    ) -> None:
        self.segment = segment
        self._request = request
        self._accounting = accounting
        self._tensor: torch.Tensor | None = tensor
        self._crc = crc
        self._checksums = checksums
        self._lock = threading.Lock()
        self._settled = False
        self._error: BaseException | None = None

    op = property(lambda self: self._request.op)
    path = property(lambda self: self._request.path)
    offset = property(lambda self: self._request.offset)
    nbytes = property(lambda self: self._request.nbytes)

    def done(self) -> bool:
        """True once the I/O has succeeded or failed. Never blocks."""
        return self._request.done()

    def wait(self, timeout: float | None = None) -> int:
        """Block until complete; return the bytes moved, or raise this request's error (see AioRequest)."""
        exc = self.exception(timeout)
        if exc is not None:
            raise exc
        return self.nbytes

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """Block until complete like wait(); return this request's error, or None."""
        start = time.perf_counter()
        try:
            exc = self._request.exception(timeout)
        finally:
            self._accounting.add_wait(self.op, time.perf_counter() - start)
        return self._settle(exc)

    def __repr__(self) -> str:
        return f"SegmentRequest({self.segment.name!r}: {self._request!r})"

    def _settle(self, exc: BaseException | None) -> BaseException | None:
        """The first observer of the outcome does the bookkeeping; later ones get the same answer."""
        with self._lock:
            if self._settled:
                return self._error
            self._settled = True
            name = self.segment.name
            failed_write = self.op == "write" and exc is not None and self._checksums is not None
            if failed_write and self._checksums.get(name) == self._crc:  # the recorded sum is wrong now
                self._checksums.pop(name, None)
            if self.op == "read" and exc is None and self._crc is not None:
                got = _crc32(self._tensor)
                if got != self._crc:
                    exc = AioError(
                        op="read",
                        path=self.path,
                        offset=self.offset,
                        errno=None,
                        detail=(
                            f"checksum mismatch in swap segment {name!r} ({self.nbytes} bytes): crc32 "
                            f"{got:#010x} read, {self._crc:#010x} written. The file was changed behind the "
                            "store or the disk returned bad data; the segment's contents are lost"
                        ),
                    )
            if exc is None:
                self._accounting.add_done(self.op, self.nbytes)
            self._error = exc
            self._tensor = None
            return exc


# ---- preallocation ----
_libc = ctypes.CDLL(None, use_errno=True)
_fallocate = getattr(_libc, "fallocate64", None) or getattr(_libc, "fallocate", None)
if _fallocate is not None:
    _fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong]
    _fallocate.restype = ctypes.c_int


FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02


def _punch_hole(fd: int, offset: int, nbytes: int) -> bool:
    """Give the blocks of [offset, offset + nbytes) back to the filesystem, the file's size unchanged; False
    where the filesystem cannot (they stay until the file goes)."""
    return _fallocate is not None and _fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, nbytes) == 0


_PUNCHES: dict[str, bool] = {}  # folder -> whether its filesystem gave a punched block back (probed once)


def can_punch_holes(folder: str) -> bool:
    """Whether the filesystem of ``folder`` gives a punched-out block back: probed once per folder with a
    4 KiB scratch file, written, punched and removed."""
    folder = os.path.abspath(folder)
    if folder not in _PUNCHES:
        works = False
        try:
            fd, path = tempfile.mkstemp(prefix=".infinity-punch-", dir=folder)
            try:
                os.write(fd, b"\1" * 4096)
                os.fsync(fd)
                works = _punch_hole(fd, 0, 4096) and os.fstat(fd).st_blocks == 0
            finally:
                os.close(fd)
                os.unlink(path)
        except OSError:
            works = False
        _PUNCHES[folder] = works
    return _PUNCHES[folder]


class DeferredReservation:
    """[Note: deferred reservation] Stores opened while one is active (``with DeferredReservation():``) are sized
    sparse and skip their own free-space check; ``reserve()`` (on leaving the block without an error)
    preallocates them. For initialize() taking zero.Init's pieces from the same disk: each piece's blocks are
    given back as it is taken (``NvmeStore.discard``) while the engine's files fill, so the disk holds the
    model's states once, not the Init copy beside the whole run's preallocated files. The engine checked the
    run against the free space plus the Init copy first; a disk that fills meanwhile fails the write (ENOSPC,
    named) or the reservation, before training starts."""

    _local = threading.local()  # the thread's active one: an engine set up on another thread is not deferred

    def __init__(self) -> None:
        self.stores: list[NvmeStore] = []

    @classmethod
    def active(cls) -> DeferredReservation | None:
        return getattr(cls._local, "active", None)

    def __enter__(self) -> DeferredReservation:
        if DeferredReservation.active() is not None:
            raise InfinityError("a DeferredReservation is already active (initialize() runs one at a time)")
        DeferredReservation._local.active = self
        return self

    def __exit__(self, exc_type, *exc) -> None:
        DeferredReservation._local.active = None
        if exc_type is None:
            self.reserve()

    def reserve(self) -> None:
        for store in self.stores:
            if store.is_open:
                store.reserve()
        self.stores.clear()


def _free_bytes(path: str) -> int:
    """Bytes an unprivileged writer may still use on the filesystem of ``path``."""
    vfs = os.statvfs(path)
    return vfs.f_bavail * vfs.f_frsize


def _preallocate(fd: int, nbytes: int, path: str, offset: int = 0) -> None:
    """Size the file to ``offset + nbytes`` and reserve the blocks of [offset, offset + nbytes) where the
    filesystem can (fallocate), so a full disk fails here, at open, and not in the middle of training. Else
    only sized (ftruncate: sparse)."""
    if nbytes == 0:
        return
    if _fallocate is not None and _fallocate(fd, 0, offset, nbytes) == 0:
        return
    err = ctypes.get_errno() if _fallocate is not None else errno_module.ENOSYS
    if err == errno_module.ENOSPC:
        raise TierBudgetError(
            f"cannot reserve {_human(nbytes)} for the swap file {path!r}: the disk is full (ENOSPC). Other ranks "
            "or programs on this disk took the space after the free-space check; free space there or point "
            "nvme_path at a larger disk"
        )
    if err not in (errno_module.EOPNOTSUPP, errno_module.ENOSYS, errno_module.EINVAL):
        raise AioError(op="fallocate", path=path, offset=offset, errno=err, detail="could not size the swap file")
    os.ftruncate(fd, offset + nbytes)


# ---- the store ----
_run_numbers = itertools.count()


def default_run_id() -> str:
    """Time, pid and a number counting the ids this process made: unique on one host, also for several engines
    made in the same second (a GAN's two). Ranks of one run must pass one id agreed among them."""
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{next(_run_numbers)}"


class NvmeStore:
    """Named segments of one rank's training state in a swap file on NVMe, moved with an AioHandle.

    Use: ``store = NvmeStore(path, handle=h, rank=r, run_id=agreed)``, ``store.add(name, nbytes)`` per
    segment (or ``segments=[(name, nbytes), ...]``), ``store.open()``; then ``write`` / ``read`` (return
    a SegmentRequest to wait for) or ``sync_write`` / ``sync_read``; ``close()`` at the end. Also a
    context manager (opens on enter if needed, closes on exit).

    ``run_id`` names the run's folder; every rank of a run must pass the same one (the engine agrees one
    over the process group); default: time and pid (fine for one process). ``handle`` is used, not
    owned: close it yourself; so is ``read_handle``, which takes the reads where given (its own queue, so a
    read is not queued behind the writes before it: [Note: reads beside writes] in offload.py). ``checksum``:
    see the module docstring for what it costs.

    The files go away at ``close()``, when the store is collected, at interpreter exit (atexit), and on
    SIGINT / SIGTERM: the first store opened in the main thread installs handlers that remove every open
    store's files and then do what the signal did before (call the previous Python handler, e.g. raise
    KeyboardInterrupt, or restore the default action and re-send the signal). A store opened in another
    thread installs none. After such a signal the stores are closed even if the program goes on. A store
    never removes files from a forked child. Requests still in flight at close finish against the
    unlinked file (Linux frees its blocks when the last descriptor closes); their results are unusable.
    """

    def __init__(
        self,
        nvme_path: str | os.PathLike,
        *,
        handle: AioHandle,
        read_handle: AioHandle | None = None,
        rank: int = 0,
        run_id: str | None = None,
        segments: Iterable[tuple[str, int]] = (),
        checksum: bool = False,
    ) -> None:
        for what in (handle, read_handle or handle):
            if not isinstance(what, AioHandle):
                raise ConfigError(f"NvmeStore needs an AioHandle to move its bytes, got {type(what).__name__}")
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise ConfigError(f"rank must be a non-negative integer, got {rank!r}")
        run_id = default_run_id() if run_id is None else run_id
        if not isinstance(run_id, str) or not _RUN_ID.fullmatch(run_id):
            raise ConfigError(
                f"run_id {run_id!r} cannot name a folder: use 1-100 characters of letters, digits, '.', '_', '-', "
                "starting with a letter or digit"
            )
        if not isinstance(checksum, bool):
            raise ConfigError(f"checksum must be true or false, got {checksum!r}")
        self.nvme_path = os.path.abspath(os.fspath(nvme_path))
        self.rank = rank
        self.run_id = run_id
        self.checksum = checksum
        self._handle = handle
        self._read_handle = read_handle or handle  # [Note: reads beside writes]
        self._files = SwapFolder(self.nvme_path, run_id, rank)
        # fixed at open, then grown in place by append() (zero.Init: one segment per parameter, so never copied)
        self._segments: dict[str, Segment] | None = None
        self._end = 0  # the swap file's size once open: the end of the last segment's padding
        self._closed = False
        self._sizes: dict[str, int] = {}
        self._next_offset = 0
        for name, nbytes in segments:
            self.add(name, nbytes)
        self._checksums: dict[str, int] | None = {} if checksum else None
        self._accounting = _Accounting()
        self._finalizer: weakref.finalize | None = None

    # ---- where things are ----
    @property
    def folder(self) -> str:
        """This rank's folder: <nvme_path>/infinity-<run id>/rank<r>."""
        return self._files.rank_dir

    @property
    def swap_path(self) -> str:
        return self._files.swap_path

    @property
    def lock_path(self) -> str:
        return self._files.lock_path

    @property
    def layout(self) -> SwapLayout:
        """The segments' places now (a snapshot; before open, what open would use). It is built from every
        segment: for inspection, not for a loop that appends."""
        if self._segments is None:
            return SwapLayout.from_sizes(self._sizes.items())
        return SwapLayout(tuple(self._segments.values()))

    @property
    def is_open(self) -> bool:
        return self._segments is not None and not self._closed

    @property
    def stats(self) -> StoreStats:
        """Bytes moved and seconds waited, per direction, so far (a copy)."""
        return self._accounting.snapshot()

    # ---- setting up ----
    def add(self, name: str, nbytes: int) -> Segment:
        """Declare a segment of ``nbytes`` bytes. Only before open(): the layout is fixed then."""
        if self._segments is not None or self._closed:
            raise ConfigError(f"swap segment {name!r}: segments can only be added before the store is opened")
        _check_segment(name, nbytes)
        if name in self._sizes:
            raise ConfigError(f"swap segment {name!r} is already in this store; segment names must be unique")
        self._sizes[name] = nbytes
        segment = Segment(name, self._next_offset, nbytes)
        self._next_offset = segment.end
        return segment

    def open(self) -> NvmeStore:
        """Check nvme_path and free space, remove stale folders, make and lock this rank's folder, create
        and preallocate the swap file. Nothing is written before the checks pass."""
        if self._closed:
            raise ConfigError(f"the swap store at {self.folder!r} is closed; make a new NvmeStore")
        if self._segments is not None:
            raise ConfigError(f"the swap store at {self.folder!r} is already open")
        check_nvme_path(self.nvme_path)
        remove_stale_folders(self.nvme_path)
        layout = SwapLayout.from_sizes(self._sizes.items())
        free = _free_bytes(self.nvme_path)
        deferred = DeferredReservation.active()
        if deferred is None and layout.total_bytes > free:
            raise TierBudgetError(
                f"the NVMe swap file of rank {self.rank} needs {layout.total_bytes} bytes "
                f"({_human(layout.total_bytes)}, {len(layout)} segments) but {self.nvme_path!r} has {free} bytes "
                f"({_human(free)}) free: free space there, set nvme_path to a larger disk, or offload less to NVMe"
            )
        files = self._files
        try:
            files.lock()
            files.swap = open_file(
                files.swap_path, write=True, direct=self._handle.settings.use_direct_io, exclusive=True, mode=0o600
            )
            if deferred is None:
                _preallocate(files.swap.buffered_fd, layout.total_bytes, files.swap_path)
            else:
                os.ftruncate(files.swap.buffered_fd, layout.total_bytes)  # sparse until reserve()
                deferred.stores.append(self)
        except BaseException:
            files.remove()
            raise
        self._segments = {segment.name: segment for segment in layout}
        self._end = layout.total_bytes
        self._finalizer = weakref.finalize(self, files.remove)  # also runs at interpreter exit (atexit)
        files.guard()
        return self

    def append(self, name: str, nbytes: int) -> Segment:
        """Add a segment to an open store, at the end of its file (zero.Init writes each parameter's piece as
        its module is built, before anyone knows the whole model). Its space is checked and reserved now."""
        if not self.is_open:
            raise ConfigError(f"swap segment {name!r}: append() needs an open store (add() before open())")
        _check_segment(name, nbytes)
        if name in self._segments:
            raise ConfigError(f"swap segment {name!r} is already in this store; segment names must be unique")
        segment = Segment(name, self._end, nbytes)
        free = _free_bytes(self.nvme_path)
        if segment.padded_nbytes > free:
            raise TierBudgetError(
                f"the NVMe swap file of rank {self.rank} needs {_human(segment.padded_nbytes)} more for segment "
                f"{name!r} but {self.nvme_path!r} has {_human(free)} free: free space there, set nvme_path to a "
                "larger disk, or offload less to NVMe"
            )
        _preallocate(self._files.swap.buffered_fd, segment.padded_nbytes, self.swap_path, offset=segment.offset)
        self._segments[name] = segment  # in place: appending P segments costs O(P), not O(P^2)
        self._end = segment.end
        self._sizes[name] = nbytes
        return segment

    def reserve(self) -> None:
        """Preallocate a store opened sparse ([Note: deferred reservation]): blocks written already stay."""
        _preallocate(self._files.swap.buffered_fd, self._end, self.swap_path)

    def discard(self, name: str) -> bool:
        """Segment ``name`` is no longer needed: its blocks go back to the filesystem (True), or stay until the
        store closes where it cannot punch holes (False). Reading or writing it afterwards is an error."""
        segment = self._segments.pop(name) if self.is_open and name in self._segments else None
        if segment is None:
            return False
        self._sizes.pop(name, None)
        if self._checksums is not None:
            self._checksums.pop(name, None)
        return _punch_hole(self._files.swap.buffered_fd, segment.offset, segment.padded_nbytes)

    # ---- I/O ----
    def write(self, name: str, tensor: torch.Tensor) -> SegmentRequest:
        """Queue a write of ``tensor`` (exactly the segment's size) into segment ``name``. Do not change the
        tensor until the request is complete."""
        segment = self._segment(name, tensor)
        crc = None
        if self._checksums is not None:
            crc = _crc32(tensor)
            self._checksums[name] = crc  # reads from now on expect these bytes; a failed write drops it
        request = self._handle.submit_pwrite(tensor, self._files.swap, segment.offset)
        return self._wrap(segment, request, tensor, crc)

    def read(self, name: str, tensor: torch.Tensor) -> SegmentRequest:
        """Queue a read of segment ``name`` into ``tensor`` (exactly the segment's size). A swap file that is
        missing, replaced or shorter than at open raises AioError here, before anything is queued."""
        segment = self._segment(name, tensor)
        self._check_swap_file(segment)
        crc = self._checksums.get(name) if self._checksums is not None else None
        request = self._read_handle.submit_pread(tensor, self._files.swap, segment.offset)
        return self._wrap(segment, request, tensor, crc)

    def sync_write(self, name: str, tensor: torch.Tensor) -> int:
        """write() and wait: returns the bytes written."""
        return self.write(name, tensor).wait()

    def sync_read(self, name: str, tensor: torch.Tensor) -> int:
        """read() and wait: returns the bytes read."""
        return self.read(name, tensor).wait()

    def _wrap(self, segment: Segment, request: AioRequest, tensor: torch.Tensor, crc: int | None) -> SegmentRequest:
        return SegmentRequest(
            segment=segment,
            request=request,
            accounting=self._accounting,
            tensor=tensor,
            crc=crc,
            checksums=self._checksums,
        )

    def _segment(self, name: str, tensor: torch.Tensor) -> Segment:
        if not self.is_open:
            state = "closed" if self._closed else "not open yet (call open())"
            raise ConfigError(f"swap segment {name!r}: the swap store at {self.folder!r} is {state}")
        try:
            segment = self._segments[name]
        except KeyError:
            known = ", ".join(repr(n) for n in itertools.islice(self._segments, 5))
            more = f" and {len(self._segments) - 5} more" if len(self._segments) > 5 else ""
            raise ConfigError(
                f"no swap segment {name!r} in the store at {self.folder!r} (it has {known or 'none'}{more}); "
                "add every segment before open()"
            ) from None
        if not isinstance(tensor, torch.Tensor):
            raise InvalidTensorError(f"swap segment {name!r}: expected a torch.Tensor, got {type(tensor).__name__}")
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes != segment.nbytes:
            raise InvalidTensorError(
                f"swap segment {name!r} holds {segment.nbytes} bytes but the tensor has {nbytes} "
                f"(shape {tuple(tensor.shape)}, {tensor.dtype}): pass a tensor of exactly the segment's size"
            )
        return segment

    def _check_swap_file(self, segment: Segment) -> None:
        """Fail loudly, naming the file, rather than read short or read someone else's bytes. The reads go
        through the descriptors opened at open(), which keep reading an unlinked or replaced file: so the
        path is checked against them here."""
        path, expected = self.swap_path, self._end
        try:
            on_disk = os.stat(path)
        except FileNotFoundError:
            raise AioError(
                op="read",
                path=path,
                offset=segment.offset,
                errno=errno_module.ENOENT,
                detail=(
                    f"the swap file of segment {segment.name!r} was deleted while the store was open (a cleanup "
                    "job? a program sharing nvme_path?); its contents are lost: restart from a checkpoint"
                ),
            ) from None
        held = self._files.swap.fstat()
        if (on_disk.st_dev, on_disk.st_ino) != (held.st_dev, held.st_ino):
            raise AioError(
                op="read",
                path=path,
                offset=segment.offset,
                errno=None,
                detail=(
                    f"the swap file of segment {segment.name!r} was replaced by another file while the store was "
                    "open; its contents are lost: restart from a checkpoint"
                ),
            )
        if on_disk.st_size < expected:
            raise ShortTransferError(
                op="read",
                path=path,
                offset=segment.offset,
                errno=None,
                detail=(
                    f"the swap file has {on_disk.st_size} bytes but was sized to {expected} at open: it was "
                    f"truncated, so segment {segment.name!r} and those after it may be lost; restart from a checkpoint"
                ),
            )

    # ---- teardown ----
    def close(self) -> None:
        """Remove the swap file and this rank's folder (and the run's folder once empty), release the lock.
        Idempotent. The handle stays open: it is the caller's."""
        self._closed = True
        if self._finalizer is not None:
            self._finalizer()  # runs files.remove once
        else:
            self._files.remove()

    def __enter__(self) -> NvmeStore:
        if self._segments is None:
            self.open()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "open" if self.is_open else ("closed" if self._closed else "not open")
        return f"NvmeStore({self.folder!r}, {len(self._sizes)} segments, {state})"
