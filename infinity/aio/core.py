"""Typed wrappers over the C core (infinity._aio): one per call; each checks the return code and
raises an AioError that names the path, offset and errno. Nothing here decides policy."""

from __future__ import annotations

import errno as errno_module
import math
import os
import threading
from dataclasses import dataclass

from infinity._aio import ffi, lib
from infinity.errors import AioError, AioTimeoutError, ConfigError, ShortTransferError

BACKEND = ffi.string(lib.inf_backend()).decode()

DEFAULT_TIMEOUT_S = 300.0
"""How long a direct-I/O loop waits for the next completion before giving up on the device."""
TIMEOUT_ENV = "INFINITY_AIO_TIMEOUT_S"
"""Environment variable read when no timeout_s is passed."""


def resolve_timeout_s(timeout_s: float | None = None) -> float:
    """``timeout_s`` if given, else $INFINITY_AIO_TIMEOUT_S if set, else DEFAULT_TIMEOUT_S.

    Seconds, > 0; ``math.inf`` waits without limit. Anything else raises ConfigError naming the value."""
    rule = "must be a number of seconds > 0 (inf: no limit)"
    if timeout_s is None:
        raw = os.environ.get(TIMEOUT_ENV, "").strip()
        if not raw:
            return DEFAULT_TIMEOUT_S
        try:
            value = float(raw)
        except ValueError:
            value = math.nan
        if not value > 0:
            raise ConfigError(f"{TIMEOUT_ENV} {rule}, got {raw!r}")
        return value
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise ConfigError(f"timeout_s {rule}, got {timeout_s!r}")
    return float(timeout_s)


def _timeout_ns(timeout_s: float) -> int:
    """For the C loop: nanoseconds, at least 1; -1 (no limit) for inf or beyond int64."""
    if math.isinf(timeout_s):
        return -1
    ns = max(1, round(timeout_s * 1e9))
    return ns if ns < 1 << 62 else -1


# Contexts whose requests timed out, with the owners of the memory those requests use. Never freed.
_QUARANTINE: list[tuple[AioContext, tuple[object, ...]]] = []
_QUARANTINE_LOCK = threading.Lock()


@dataclass(frozen=True, slots=True)
class LoopSettings:
    """How one blocked loop splits and queues a request (the DeepSpeed `aio` knobs, per thread)."""

    block_size: int
    queue_depth: int
    single_submit: bool
    overlap_events: bool


class AioContext:
    """One kernel AIO context (io_setup / io_destroy), used by one thread at a time."""

    def __init__(self, max_events: int) -> None:
        self.max_events = max_events
        self._ctx = ffi.new("aio_context_t *")
        rc = lib.inf_io_setup(max_events, self._ctx)
        if rc < 0:
            err = -rc
            hint = (
                "the system-wide limit fs.aio-max-nr is exhausted: lower queue_depth or "
                "intra_op_parallelism, close unused handles, or raise fs.aio-max-nr"
                if err == errno_module.EAGAIN
                else "check queue_depth"
            )
            raise AioError(op=f"io_setup({max_events})", path="<aio context>", offset=0, errno=err, detail=hint)
        self._lock = threading.Lock()
        self.closed = False
        self.quarantined = False

    @property
    def handle(self):
        return self._ctx[0]

    def close(self) -> None:
        """io_destroy waits for anything still in flight, so buffers are safe to reuse after.

        A quarantined context is left alone (see quarantine)."""
        if not self.closed and not self.quarantined:
            self.closed = True
            lib.inf_io_destroy(self._ctx[0])

    def recreate(self) -> None:
        """After a failed reap the context may still own requests: destroy it and start a new one."""
        self.close()
        rc = lib.inf_io_setup(self.max_events, self._ctx)
        if rc < 0:
            raise AioError(op=f"io_setup({self.max_events})", path="<aio context>", offset=0, errno=-rc)
        self.closed = False

    def quarantine(self, *keep_alive: object) -> None:
        """Retire this context after a timeout, with the owners of the memory its requests use.

        Note: requests that timed out are still in flight. The kernel may yet write into (reads) or read
        from (writes) their memory, and io_destroy would wait for them, forever on a dead device. So the
        context is never destroyed nor used again, and it and ``keep_alive`` (the tensors or buffers
        holding that memory) are referenced for the life of the process: the memory is never freed and
        reused under the kernel. The cost is the context's events against fs.aio-max-nr, and the memory."""
        with _QUARANTINE_LOCK:
            self.quarantined = True
            _QUARANTINE.append((self, keep_alive))


def _raise_for_status(
    status, *, kind: int, is_write: bool, path: str, offset: int, timeout_s: float | None = None
) -> None:
    op = "write" if is_write else "read"
    fail_offset = int(status.fail_offset) if status.fail_offset >= 0 else offset
    length = int(status.fail_length)
    if kind == lib.INF_ERR_TIMEOUT:
        raise AioTimeoutError(
            op=op,
            path=path,
            offset=fail_offset,
            errno=errno_module.ETIMEDOUT,
            detail=(
                f"a request of {length} bytes did not complete within {timeout_s:g} s ({int(status.bytes_done)} "
                "bytes had completed): the disk or device may be stalled. Its memory and AIO context stay "
                "reserved for the life of the process, since the kernel may still use them. If the device is "
                f"only slow, raise the timeout: AioHandle(timeout_s=...) or the environment variable {TIMEOUT_ENV}"
            ),
        )
    if kind == lib.INF_ERR_SHORT:
        got = int(status.fail_result)
        if is_write:
            detail = (
                f"short write: {got} of {length} bytes written (is the disk full? check free space "
                "where the file lives)"
            )
        else:
            detail = (
                f"short read: {got} of {length} bytes (end of file at offset {fail_offset + got}); the "
                "file is shorter than the tensor: was it truncated, or written from a smaller tensor?"
            )
        raise ShortTransferError(op=op, path=path, offset=fail_offset, errno=None, detail=detail)
    err = int(status.error_errno) or errno_module.EIO
    stage = {
        lib.INF_ERR_ARGUMENT: "bad request arguments",
        lib.INF_ERR_SETUP: "allocating the request queue",
        lib.INF_ERR_SUBMIT: "io_submit",
        lib.INF_ERR_REAP: "io_getevents",
        lib.INF_ERR_IO: f"request of {length} bytes",
    }.get(kind, f"error kind {kind}")
    if err == errno_module.EINVAL and kind in (lib.INF_ERR_SUBMIT, lib.INF_ERR_IO):
        stage += " (direct I/O needs buffer address, offset and length aligned to the device's block size)"
    if err == errno_module.ENOSPC:
        stage += " (the disk is full: free space or point nvme_path elsewhere)"
    raise AioError(op=op, path=path, offset=fail_offset, errno=err, detail=stage)


def rw_direct(
    context: AioContext,
    fd: int,
    *,
    is_write: bool,
    address: int,
    nbytes: int,
    offset: int,
    settings: LoopSettings,
    path: str,
    buffer_wrap: int = 0,
    timeout_s: float | None = None,
    keep_alive: object = None,
) -> None:
    """Move nbytes between host memory at ``address`` and ``fd`` (opened O_DIRECT) at ``offset``.

    buffer_wrap > 0 streams the file range through a ring of that many bytes at ``address``.
    timeout_s (None: resolve_timeout_s()) bounds each wait for a completion. When it passes, this raises
    AioTimeoutError and quarantines ``context`` together with ``keep_alive``, the object that owns the
    memory at ``address`` (see AioContext.quarantine); a quarantined context refuses later calls."""
    if settings.queue_depth > context.max_events:
        raise ConfigError(f"queue_depth {settings.queue_depth} exceeds this AIO context's {context.max_events} events")
    timeout_s = resolve_timeout_s(timeout_s)
    status = ffi.new("inf_status *")
    with context._lock:
        if context.quarantined:
            raise AioError(
                op="write" if is_write else "read",
                path=path,
                offset=offset,
                errno=None,
                detail=(
                    "this AIO context is quarantined: a request on it timed out earlier and may still be "
                    "in flight; use a new AioHandle"
                ),
            )
        kind = lib.inf_rw_direct(
            context.handle,
            fd,
            int(is_write),
            ffi.cast("void *", address),
            nbytes,
            offset,
            settings.block_size,
            settings.queue_depth,
            int(settings.single_submit),
            int(settings.overlap_events),
            buffer_wrap,
            _timeout_ns(timeout_s),
            status,
        )
        if kind == lib.INF_ERR_REAP:
            context.recreate()
        elif kind == lib.INF_ERR_TIMEOUT:
            context.quarantine(keep_alive)
    if kind:
        _raise_for_status(status, kind=kind, is_write=is_write, path=path, offset=offset, timeout_s=timeout_s)


def rw_buffered(fd: int, *, is_write: bool, address: int, nbytes: int, offset: int, path: str) -> None:
    """The same with pread/pwrite: for files that refuse O_DIRECT and for unaligned pieces."""
    status = ffi.new("inf_status *")
    kind = lib.inf_rw_buffered(fd, int(is_write), ffi.cast("void *", address), nbytes, offset, status)
    if kind:
        _raise_for_status(status, kind=kind, is_write=is_write, path=path, offset=offset)
