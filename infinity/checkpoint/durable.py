"""Making files durable and swapping folders in atomically ([Note: crash-safe save] in save.py)."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import shutil
import uuid

from infinity.aio.files import fsync_path

_libc = None


def _libc_function(name: str):
    """A libc function by name (Linux), or None where there is no such function."""
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        except OSError:
            _libc = False
    return getattr(_libc, name, None) if _libc else None


def _syncfs():
    return _libc_function("syncfs")


def sync_files(folder: str, paths: list[str]) -> None:
    """Everything in ``paths`` reaches the disk: one syncfs() of the file system holding ``folder`` where Linux
    has it (one journal commit instead of one per chunk file), else an fsync per file."""
    syncfs = _syncfs()
    if syncfs is not None:
        fd = os.open(folder, os.O_RDONLY)
        try:
            if syncfs(fd) == 0:
                return
        finally:
            os.close(fd)
    for path in paths:
        fsync_path(path)


def write_durably(path: str, text: str) -> None:
    """``path`` <- text, atomically: a temporary file, fsynced, renamed over it, the folder fsynced."""
    folder = os.path.dirname(os.path.abspath(path))
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)  # a full disk: the old file stays, and no half-written one beside it
        raise
    fsync_path(folder)


def free_bytes(path: str) -> int:
    """Bytes an unprivileged writer may still use on the file system holding ``path``."""
    vfs = os.statvfs(path)
    return vfs.f_bavail * vfs.f_frsize


RENAME_EXCHANGE = 2  # renameat2's flag (Linux >= 3.15): swap two paths atomically
AT_FDCWD = -100


def _exchange(first: str, second: str) -> bool:
    renameat2 = _libc_function("renameat2")
    if renameat2 is None:
        return False
    return renameat2(AT_FDCWD, os.fsencode(first), AT_FDCWD, os.fsencode(second), RENAME_EXCHANGE) == 0


def publish_folder(tmp: str, final: str) -> None:
    """Renames the finished ``tmp`` folder to ``final``. An existing ``final`` (the same tag saved again) is
    swapped with it atomically (renameat2) and the old one removed, so ``final`` is never missing; where the
    kernel cannot swap, the old one is moved aside to ``final.old-*`` first, and a load finds it there if a crash
    comes between the two renames (load.py)."""
    parent = os.path.dirname(os.path.abspath(final))
    old = None
    if os.path.exists(final):
        if _exchange(tmp, final):
            old = tmp  # now holds the previous checkpoint
        else:
            old = f"{final}.old-{uuid.uuid4().hex[:8]}"
            os.rename(final, old)
            os.rename(tmp, final)
    else:
        os.rename(tmp, final)
    fsync_path(parent)
    if old is not None:
        with contextlib.suppress(OSError):
            shutil.rmtree(old)
