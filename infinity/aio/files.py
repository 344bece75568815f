"""Opening files for the I/O engine: O_DIRECT where the filesystem allows, else buffered with one
warning per file. Every failure is an AioError naming the path."""

from __future__ import annotations

import errno as errno_module
import os
import stat
import threading
import warnings
from dataclasses import dataclass

from infinity.errors import AioError


class DirectIOFallbackWarning(RuntimeWarning):
    """A file is read/written through the page cache because its filesystem refused O_DIRECT."""


@dataclass(slots=True)
class OpenFile:
    """The descriptors one request uses. ``direct_fd`` is None when direct I/O is off or refused;
    ``buffered_fd`` serves the unaligned pieces (and everything, without direct I/O)."""

    path: str
    direct_fd: int | None
    buffered_fd: int | None
    size: int  # bytes, at open; 0 for block devices
    is_regular: bool

    def close(self) -> None:
        for fd in (self.direct_fd, self.buffered_fd):
            if fd is not None:
                os.close(fd)
        self.direct_fd = self.buffered_fd = None


_warned_paths: set[str] = set()
_warned_lock = threading.Lock()


def _warn_fallback_once(path: str, err: int) -> None:
    with _warned_lock:
        if path in _warned_paths:
            return
        _warned_paths.add(path)
    warnings.warn(
        f"{path!r}: the filesystem refused O_DIRECT ({errno_module.errorcode.get(err, err)}), so this file "
        "uses buffered pread/pwrite: slower, and it occupies the page cache. Put nvme_path on a "
        "filesystem that supports direct I/O (ext4, xfs) for full speed.",
        DirectIOFallbackWarning,
        stacklevel=5,
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


def _open(path: str, flags: int, *, op: str) -> int:
    try:
        return os.open(path, flags | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise _open_error(path, op, e.errno) from None


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
