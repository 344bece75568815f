"""Typed wrappers over the C core (infinity._aio): one per call; each checks the return code and
raises an AioError that names the path, offset and errno. Nothing here decides policy."""

from __future__ import annotations

import errno as errno_module
import threading
from dataclasses import dataclass

from infinity._aio import ffi, lib
from infinity.errors import AioError, ConfigError, ShortTransferError

BACKEND = ffi.string(lib.inf_backend()).decode()


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

    @property
    def handle(self):
        return self._ctx[0]

    def close(self) -> None:
        """io_destroy waits for anything still in flight, so buffers are safe to reuse after."""
        if not self.closed:
            self.closed = True
            lib.inf_io_destroy(self._ctx[0])

    def recreate(self) -> None:
        """After a failed reap the context may still own requests: destroy it and start a new one."""
        self.close()
        rc = lib.inf_io_setup(self.max_events, self._ctx)
        if rc < 0:
            raise AioError(op=f"io_setup({self.max_events})", path="<aio context>", offset=0, errno=-rc)
        self.closed = False


def _raise_for_status(status, *, kind: int, is_write: bool, path: str, offset: int) -> None:
    op = "write" if is_write else "read"
    fail_offset = int(status.fail_offset) if status.fail_offset >= 0 else offset
    length = int(status.fail_length)
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
) -> None:
    """Move nbytes between host memory at ``address`` and ``fd`` (opened O_DIRECT) at ``offset``.

    buffer_wrap > 0 streams the file range through a ring of that many bytes at ``address``."""
    if settings.queue_depth > context.max_events:
        raise ConfigError(f"queue_depth {settings.queue_depth} exceeds this AIO context's {context.max_events} events")
    status = ffi.new("inf_status *")
    with context._lock:
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
            status,
        )
        if kind == lib.INF_ERR_REAP:
            context.recreate()
    if kind:
        _raise_for_status(status, kind=kind, is_write=is_write, path=path, offset=offset)


def rw_buffered(fd: int, *, is_write: bool, address: int, nbytes: int, offset: int, path: str) -> None:
    """The same with pread/pwrite: for files that refuse O_DIRECT and for unaligned pieces."""
    status = ffi.new("inf_status *")
    kind = lib.inf_rw_buffered(fd, int(is_write), ffi.cast("void *", address), nbytes, offset, status)
    if kind:
        _raise_for_status(status, kind=kind, is_write=is_write, path=path, offset=offset)
