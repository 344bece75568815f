"""The swap folder of one store: where its files live, the lock that says its run is alive, and their removal.

A store's files live in ``<nvme_path>/infinity-<run id>/rank<r>/``: ``lock`` and ``swap``. This module makes and
locks that folder, removes it (at the store's close, at interpreter exit, on SIGINT / SIGTERM), and removes the
folders of runs that are gone; the store (nvme_store.py) only says when. Kept apart so the store is about
segments and bytes, and so cleanup can run from weakref.finalize and signal handlers without the store.

[Note: swap folder lock]
Each store lives in <nvme_path>/infinity-<run id>/rank<r>/ holding two files: ``lock`` and ``swap``.
The store holds fcntl.flock(LOCK_EX) on ``lock`` for its whole life; the file says who (pid, host).
flock is dropped by the kernel when its holder dies, however it dies (SIGKILL, OOM killer, power cut
of the process), so "the lock can be taken" means exactly "the run that made this folder is gone".
At open, a store looks at every infinity-*/rank*/ folder under nvme_path and removes those whose lock
it can take (one log line for all of them); folders whose lock is held are left alone, so runs that share
a disk never touch each other's files, and two stores can only share a folder by sharing run id and rank (an
error). Whoever removes a folder holds its lock while doing so and unlinks the lock file last; whoever
takes a lock checks afterwards that the lock file at the path is still the file it locked (same inode),
and starts over otherwise. So a store being made and a scan running at the same time cannot both think
they own a folder. A folder with no lock file at all (its run died between mkdir and creating the lock)
is removed once it is older than a minute. Caveat: on a network filesystem whose flock is local to each
host, a folder in use by another host looks stale; nvme_path is meant to be a local disk.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import shutil
import signal
import socket
import threading
import time

from infinity.aio.files import AioFile
from infinity.errors import ConfigError

logger = logging.getLogger("infinity")

RUN_PREFIX = "infinity-"
LOCK_NAME = "lock"
SWAP_NAME = "swap"
_RANK_DIR = re.compile(r"rank\d+")
_LOCK_BUSY_WAIT_S = 2.0  # a scanner holds a live folder's lock only for an instant; a run holds it for good
_LOCKLESS_GRACE_S = 60.0  # a folder without a lock file younger than this may be one being made now


def _mib(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):.1f} MiB"


def check_nvme_path(path: str) -> None:
    """Every way nvme_path can be unusable, found at open before anything is written."""
    if not os.path.exists(path):
        raise ConfigError(
            f"nvme_path {path!r} does not exist: create it (mkdir -p) on a local NVMe disk, or set "
            "offload_param.nvme_path / offload_optimizer.nvme_path to a directory that exists"
        )
    if not os.path.isdir(path):
        raise ConfigError(
            f"nvme_path {path!r} is not a directory: set nvme_path to a directory on a local NVMe disk "
            "(the store makes its own folder inside it)"
        )
    if os.statvfs(path).f_flag & os.ST_RDONLY:
        raise ConfigError(
            f"nvme_path {path!r} is on a read-only filesystem: remount it read-write, or set nvme_path to a "
            "directory on a writable local disk"
        )
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(
            f"nvme_path {path!r} is not writable by this process (uid {os.getuid()}): give it write permission "
            "(chmod u+wx, or chown to this user), or set nvme_path to a directory this user can write"
        )


class SwapFolder:
    """One store's folder, its lock and its swap file. Apart from NvmeStore so cleanup can run from
    weakref.finalize (at exit, or when a store is collected) and from the signal handlers."""

    def __init__(self, nvme_path: str, run_id: str, rank: int) -> None:
        self.nvme_path = nvme_path
        self.run_id = run_id
        self.rank = rank
        self.run_dir = os.path.join(nvme_path, RUN_PREFIX + run_id)
        self.rank_dir = os.path.join(self.run_dir, f"rank{rank}")
        self.lock_path = os.path.join(self.rank_dir, LOCK_NAME)
        self.swap_path = os.path.join(self.rank_dir, SWAP_NAME)
        self.lock_fd: int | None = None
        self.swap: AioFile | None = None  # every segment request borrows its descriptors
        self.owner_pid = os.getpid()

    def lock(self) -> None:
        """Make this rank's folder and take its lock (see [Note: swap folder lock]); a live holder of the same
        folder is a ConfigError. What a dead holder left in the folder is removed."""
        deadline = time.monotonic() + _LOCK_BUSY_WAIT_S
        for _attempt in range(100):
            try:  # mkdir, not makedirs: never create nvme_path itself
                for folder in (self.run_dir, self.rank_dir):
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(folder, 0o755)
                fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            except FileNotFoundError:
                if not os.path.isdir(self.nvme_path):
                    check_nvme_path(self.nvme_path)
                continue  # a scan removed the run folder between two calls: make it again
            except OSError as e:
                raise ConfigError(
                    f"cannot create the swap folder {self.rank_dir!r}: {os.strerror(e.errno)}; check that "
                    "nvme_path is writable by this user"
                ) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_holder(fd)
                os.close(fd)
                if time.monotonic() < deadline:
                    time.sleep(0.05)
                    continue
                raise ConfigError(
                    f"the swap folder {self.rank_dir!r} is in use by a live process ({holder}): two stores with "
                    f"run id {self.run_id!r} and rank {self.rank}. Give each run its own run id"
                ) from None
            if not _same_file(fd, self.lock_path):
                os.close(fd)  # a scan removed it after we opened it: start over
                continue
            self.lock_fd = fd
            break
        else:
            raise ConfigError(
                f"could not make and lock the swap folder {self.rank_dir!r}: something keeps removing it; "
                "is another program cleaning nvme_path?"
            )
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()}\nhost {socket.gethostname()}\nrun {self.run_id}\n".encode(), 0)
        for entry in os.scandir(self.rank_dir):  # a dead holder's leftovers (we hold the lock now)
            if entry.name != LOCK_NAME:
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path, ignore_errors=True)
                else:
                    _unlink_quietly(entry.path)

    def guard(self) -> None:
        """From now on SIGINT and SIGTERM remove the folder too (see NvmeStore)."""
        _live_folders.add(self)
        _install_signal_handlers()

    def remove(self) -> None:
        """Remove the files and folders, then release the lock. Idempotent; each step tolerates a
        half-done earlier attempt (a signal may interrupt close())."""
        _live_folders.discard(self)
        if os.getpid() != self.owner_pid:
            return  # a forked child: the parent owns the files, and the flock it shares with us
        swap, self.swap = self.swap, None
        if swap is not None:
            swap.close()  # requests still in flight keep its descriptors until they complete
        lock_fd, self.lock_fd = self.lock_fd, None
        if lock_fd is None:
            return
        try:  # under the lock: nobody else may take this folder while it is half gone
            _unlink_quietly(self.swap_path)
            _unlink_quietly(self.lock_path)
            shutil.rmtree(self.rank_dir, ignore_errors=True)
            _rmdir_quietly(self.run_dir)  # only if empty: other ranks of the run may share it
        finally:
            os.close(lock_fd)


# ---- what the signal handlers remove ----
_live_folders: set[SwapFolder] = set()
_previous_handlers: dict[int, object] = {}
_hooks_lock = threading.Lock()


def _remove_all() -> None:
    for folder in list(_live_folders):
        folder.remove()


def _on_signal(signum: int, frame) -> None:
    """Remove every open store's files, then do what the signal did before (see NvmeStore)."""
    _remove_all()
    previous = _previous_handlers.get(signum)
    if callable(previous):
        previous(signum, frame)
        return
    signal.signal(signum, signal.SIG_DFL)  # the default action (terminate), as if we had never been here
    os.kill(os.getpid(), signum)


def _install_signal_handlers() -> None:
    if threading.current_thread() is not threading.main_thread():
        return  # signal.signal works only there; atexit and close() still clean up
    with _hooks_lock:
        for signum in (signal.SIGINT, signal.SIGTERM):
            if signum in _previous_handlers:
                continue
            current = signal.getsignal(signum)
            if current is None or current == signal.SIG_IGN:
                continue  # set from C (unknown to us), or deliberately ignored: leave it so
            signal.signal(signum, _on_signal)
            _previous_handlers[signum] = current


def _unlink_quietly(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _rmdir_quietly(path: str) -> None:
    with contextlib.suppress(OSError):
        os.rmdir(path)


def _same_file(fd: int, path: str) -> bool:
    try:
        on_disk = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (on_disk.st_dev, on_disk.st_ino) == (held.st_dev, held.st_ino)


def _read_holder(fd: int) -> str:
    try:
        text = os.pread(fd, 512, 0).decode(errors="replace")
    except OSError:
        return "unknown"
    fields = dict(line.split(" ", 1) for line in text.splitlines() if " " in line)
    if "pid" not in fields:
        return "unknown (empty lock file)"
    return f"pid {fields['pid']} on host {fields.get('host', '?')}"


def _folder_bytes(path: str) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_size
    return total


def remove_stale_folders(nvme_path: str) -> list[str]:
    """Remove the rank folders under ``nvme_path`` left by runs that are gone; return their paths.

    A folder is stale when its lock can be taken (see [Note: swap folder lock]). Folders in use are left
    alone. One log line for all removed (a killed run leaves one folder per kind: parameters, gradients,
    optimizer)."""
    removed: dict[str, list[str]] = {}  # why -> folders
    nbytes = 0
    try:
        runs = [e for e in os.scandir(nvme_path) if e.name.startswith(RUN_PREFIX) and e.is_dir(follow_symlinks=False)]
    except OSError:
        return []
    for run in runs:
        try:
            ranks = [e for e in os.scandir(run.path) if _RANK_DIR.fullmatch(e.name) and e.is_dir(follow_symlinks=False)]
        except OSError:
            continue
        for rank in ranks:
            found = _remove_if_stale(rank.path)
            if found is not None:
                removed.setdefault(found[0], []).append(rank.path)
                nbytes += found[1]
        _rmdir_quietly(run.path)  # empty: its last rank folder is gone
    folders = [path for paths in removed.values() for path in paths]
    if folders:
        logger.warning(
            "removed %d swap folder(s) (%s) of runs that are gone: %s",
            len(folders),
            _mib(nbytes),
            "; ".join(f"{', '.join(paths)} ({why})" for why, paths in removed.items()),
        )
    return folders


def _remove_if_stale(rank_dir: str) -> tuple[str, int] | None:
    """Why the folder was stale and the bytes it held, once removed; None when it is left alone."""
    lock_path = os.path.join(rank_dir, LOCK_NAME)
    try:
        fd = os.open(lock_path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        try:
            age = time.time() - os.stat(rank_dir).st_mtime
        except OSError:
            return None
        if age < _LOCKLESS_GRACE_S:
            return None  # perhaps a store making its folder right now
        nbytes = _folder_bytes(rank_dir)
        shutil.rmtree(rank_dir, ignore_errors=True)
        return "no lock file: its run died before locking it", nbytes
    except OSError:
        return None  # unreadable: not ours to judge
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return None  # held: its run is alive (or flock is unsupported here: leave it be)
        if not _same_file(fd, lock_path):
            return None  # removed or replaced while we were locking it
        holder = _read_holder(fd)
        nbytes = _folder_bytes(rank_dir)
        for entry in os.scandir(rank_dir):
            if entry.name == LOCK_NAME:
                continue
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, ignore_errors=True)
            else:
                _unlink_quietly(entry.path)
        _unlink_quietly(lock_path)  # last, while still holding it
        _rmdir_quietly(rank_dir)
    finally:
        os.close(fd)
    return f"{holder}: its lock was free", nbytes
