"""Opening files for the I/O engine: O_DIRECT where the filesystem allows, else buffered with one
warning per file. Every failure is an AioError naming the path.

Two ways a request gets its descriptors: a request given a path opens them itself (``open_for_io``) and
closes them when it completes; a request given an ``AioFile`` (``open_file``) borrows the descriptors the
caller opened once. Why both: a swap file is read and written thousands of times per step, and an open
and a close per request are syscalls and descriptor churn for nothing. The AioFile counts its borrowers,
so closing it while requests are in flight closes the descriptors only once the last one completes (a
descriptor number freed early could be reused by another file and receive that request's bytes).
"""

from __future__ import annotations

import errno as errno_module
import os
import stat
import threading
import warnings
from dataclasses import dataclass, field

from infinity.errors import AioError


class DirectIOFallbackWarning(RuntimeWarning):
    """A file is read/written through the page cache because its filesystem refused O_DIRECT."""


@dataclass(slots=True)
class OpenFile:
    """The descriptors one request uses. ``direct_fd`` is None when direct I/O is off or refused;
    ``buffered_fd`` serves the unaligned pieces (and everything, without direct I/O). ``lender``: the
    AioFile they were borrowed from (closing gives them back), None when the request opened them."""

    path: str
    direct_fd: int | None
    buffered_fd: int | None
    size: int  # bytes, at open (at submit for a borrowed file); 0 for block devices
    is_regular: bool
    lender: AioFile | None = None

    def close(self) -> None:
        lender, self.lender = self.lender, None
        if lender is not None:
            lender._give_back()
        else:
            for fd in (self.direct_fd, self.buffered_fd):
                if fd is not None:
                    os.close(fd)
        self.direct_fd = self.buffered_fd = None


@dataclass(eq=False, repr=False, slots=True)
class AioFile:
    """A file opened once for many requests: pass it to AioHandle wherever a path goes. Make it with
    ``open_file``; ``close()`` it when done (also a context manager).

    ``direct_fd`` (None when direct I/O is off or refused) and ``buffered_fd`` are the same descriptors
    a path request would open, so a request moves the same bytes the same way; the handle still decides
    per request which to use (its ``use_direct_io``, the offset's alignment, the tail). ``path`` is kept
    for error messages. Closing while requests are in flight defers closing the descriptors until the
    last of them completes; a request submitted after close() fails with EBADF, naming the path."""

    path: str
    direct_fd: int | None
    buffered_fd: int | None  # None once closed
    writable: bool
    _borrowers: int = field(default=0, init=False, repr=False)
    _closed: bool = field(default=False, init=False)
    # Reentrant: close() may run from a signal handler or a finalizer on a thread inside _lend().
    _lock: threading.RLock = field(default_factory=threading.RLock, init=False, repr=False)

    @property
    def closed(self) -> bool:
        return self._closed

    def __repr__(self) -> str:
        mode = "read-write" if self.writable else "read-only"
        state = "closed" if self._closed else ("O_DIRECT + buffered" if self.direct_fd is not None else "buffered")
        return f"AioFile({self.path!r}, {mode}, {state})"

    def fstat(self) -> os.stat_result:
        """The open file's stat (what the descriptors point at, even if the path was unlinked)."""
        with self._lock:
            if self._closed:
                raise self._closed_error("stat", 0)
            return os.fstat(self.buffered_fd)

    def close(self) -> None:
        """Idempotent. The descriptors close now, or when the last request using them completes."""
        with self._lock:
            self._closed = True
            if self._borrowers == 0:
                self._close_fds()

    def __enter__(self) -> AioFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- for AioHandle ----
    def _lend(self, *, is_write: bool, direct: bool, offset: int) -> OpenFile:
        """The descriptors for one request, with the file's size now; OpenFile.close() gives them back."""
        op = "write" if is_write else "read"
        with self._lock:
            if self._closed:
                raise self._closed_error(op, offset)
            if is_write and not self.writable:
                raise AioError(
                    op=op, path=self.path, offset=offset, errno=errno_module.EBADF,
                    detail="this AioFile was opened for reading only: open it with open_file(path, write=True)",
                )  # fmt: skip
            self._borrowers += 1
            direct_fd, buffered_fd = self.direct_fd, self.buffered_fd
        try:
            info = os.fstat(buffered_fd)
        except OSError as e:
            self._give_back()
            raise AioError(op=op, path=self.path, offset=offset, errno=e.errno, detail="fstat failed") from None
        return OpenFile(
            path=self.path,
            direct_fd=direct_fd if direct else None,
            buffered_fd=buffered_fd,
            size=info.st_size,
            is_regular=stat.S_ISREG(info.st_mode),
            lender=self,
        )

    def _give_back(self) -> None:
        with self._lock:
            self._borrowers -= 1
            if self._closed and self._borrowers == 0:
                self._close_fds()

    def _close_fds(self) -> None:
        direct_fd, buffered_fd = self.direct_fd, self.buffered_fd
        self.direct_fd = self.buffered_fd = None
        for fd in (direct_fd, buffered_fd):
            if fd is not None:
                os.close(fd)

    def _closed_error(self, op: str, offset: int) -> AioError:
        return AioError(
            op=op, path=self.path, offset=offset, errno=errno_module.EBADF,
            detail="this AioFile is closed: open the file again with open_file, or pass its path",
        )  # fmt: skip


_warned_paths: set[str] = set()
_warned_lock = threading.Lock()


def _warn_fallback_once(path: str, err: int, *, stacklevel: int = 5) -> None:
    with _warned_lock:
        if path in _warned_paths:
            return
        _warned_paths.add(path)
    warnings.warn(
        f"{path!r}: the filesystem refused O_DIRECT ({errno_module.errorcode.get(err, err)}), so this file "
        "uses buffered pread/pwrite: slower, and it occupies the page cache. Put nvme_path on a "
        "filesystem that supports direct I/O (ext4, xfs) for full speed.",
        DirectIOFallbackWarning,
        stacklevel=stacklevel,  # 5: the caller of AioHandle's I/O method that opened the file
    )


_OPEN_HINTS = {
    errno_module.ENOENT: "the file or its directory does not exist",
    errno_module.EISDIR: "the path is a directory; pass a file path",
    errno_module.EACCES: "permission denied",
    errno_module.EPERM: "operation not permitted (read-only or immutable file?)",
    errno_module.EROFS: "the filesystem is read-only",
    errno_module.ENOTDIR: "a component of the path is not a directory",
}


def _open_error(path: str, op: str, err: int | None) -> AioError:
    return AioError(op=op, path=path, offset=0, errno=err, detail=_OPEN_HINTS.get(err, "open failed"))


def _open(path: str, flags: int, *, op: str, mode: int = 0o644) -> int:
    try:
        return os.open(path, flags | os.O_CLOEXEC, mode)
    except OSError as e:
        raise _open_error(path, op, e.errno) from None


def fsync_path(path: str | os.PathLike) -> None:
    """A file's (or a folder's entries') data on the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def open_for_io(path: str | os.PathLike, *, is_write: bool, direct: bool, need_buffered: bool) -> OpenFile:
    """Open ``path`` for one request. need_buffered: also open a buffered descriptor (for tails)."""
    path = os.fspath(path)
    op = "write" if is_write else "read"
    if not is_write:
        try:
            info = os.stat(path)
        except OSError as e:
            raise _open_error(path, op, e.errno) from None
        if stat.S_ISDIR(info.st_mode):
            raise _open_error(path, op, errno_module.EISDIR)
    flags = (os.O_WRONLY | os.O_CREAT) if is_write else os.O_RDONLY
    direct_fd = None
    if direct:
        try:
            direct_fd = os.open(path, flags | os.O_DIRECT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            if e.errno != errno_module.EINVAL:
                raise _open_error(path, op, e.errno) from None
            _warn_fallback_once(path, e.errno)
    try:
        buffered_fd = _open(path, flags, op=op) if (need_buffered or direct_fd is None) else None
        info = os.fstat(direct_fd if direct_fd is not None else buffered_fd)
    except BaseException:
        if direct_fd is not None:
            os.close(direct_fd)
        raise
    return OpenFile(
        path=path,
        direct_fd=direct_fd,
        buffered_fd=buffered_fd,
        size=info.st_size,
        is_regular=stat.S_ISREG(info.st_mode),
    )


def open_file(
    path: str | os.PathLike, *, write: bool, direct: bool = True, exclusive: bool = False, mode: int = 0o644
) -> AioFile:
    """Open ``path`` once for many requests (see AioFile). ``write``: read and write (created with ``mode``
    if missing), else read only. ``direct``: also an O_DIRECT descriptor where the filesystem allows (one
    warning per path otherwise, as for a path request). ``exclusive``: create it; fail if it exists."""
    path = os.fspath(path)
    op = "write" if write else "read"
    flags = os.O_RDWR | os.O_CREAT if write else os.O_RDONLY
    if exclusive:
        if not write:
            raise ValueError("open_file: exclusive=True creates the file, so it needs write=True")
        flags |= os.O_EXCL
    buffered_fd = _open(path, flags, op=op, mode=mode)
    direct_fd = None
    try:
        if stat.S_ISDIR(os.fstat(buffered_fd).st_mode):  # O_RDONLY opens a directory without complaint
            raise _open_error(path, op, errno_module.EISDIR)
        if direct:
            try:
                direct_fd = os.open(path, (flags & ~(os.O_CREAT | os.O_EXCL)) | os.O_DIRECT | os.O_CLOEXEC)
            except OSError as e:
                if e.errno != errno_module.EINVAL:
                    raise _open_error(path, op, e.errno) from None
                _warn_fallback_once(path, e.errno, stacklevel=3)
    except BaseException:
        os.close(buffered_fd)
        raise
    return AioFile(path=path, direct_fd=direct_fd, buffered_fd=buffered_fd, writable=write)
