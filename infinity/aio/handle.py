"""AioHandle: asynchronous reads and writes of tensors to files, with DeepSpeed's method names.

How a request runs (see [Note: request path] below):
- it is split into ``intra_op_parallelism`` contiguous slices, one per worker thread; each worker owns
  one kernel AIO context and runs the C loop with the GIL released, so slices move in parallel;
- a slice's 4 KiB-aligned body goes through O_DIRECT (block_size requests, queue_depth in flight);
  an unaligned tail, an unaligned file offset, or a filesystem that refuses O_DIRECT goes through
  pread/pwrite, which writes exactly the logical bytes (nothing past the end of the tensor);
- tensors whose memory is not 4 KiB-aligned, or that live on a GPU, are staged through the worker's
  aligned huge-page buffer. Tensors from ``new_cpu_locked_tensor`` are used in place: the fast path.
  A worker copies host bytes with memmove, never with a torch op ([Note: no OpenMP off the main thread]);
- the file is opened for the request and closed when it completes, unless the caller passes an AioFile
  (opened once, see infinity/aio/files.py): then the request borrows its descriptors;
- each wait for a direct-I/O completion is bounded by the handle's ``timeout_s`` (see AioHandle);
- the last slice to finish completes the request (see infinity/aio/request.py): whoever waits for it,
  the request alone or the whole handle, blocks on that request's Event.
"""

from __future__ import annotations

import ctypes
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from infinity.aio import core
from infinity.aio.buffers import IO_ALIGNMENT, HostBuffer, allocate_host_buffer
from infinity.aio.files import AioFile, open_for_io
from infinity.aio.request import AioRequest, _Outstanding
from infinity.errors import AioError, AioTimeoutError, ConfigError, InvalidTensorError, ShortTransferError

MAX_QUEUE_DEPTH = 4096
MAX_INTRA_OP_PARALLELISM = 256
MIN_STAGING_BYTES = 8 << 20


@dataclass(frozen=True, kw_only=True, slots=True)
class AioSettings:
    """The `aio` knobs, validated. Names and defaults are DeepSpeed's."""

    block_size: int = 1 << 20
    """Bytes per kernel request; a multiple of 4096."""
    queue_depth: int = 8
    """Requests in flight per worker thread."""
    single_submit: bool = False
    """Submit one request per io_submit call instead of a batch."""
    overlap_events: bool = True
    """Refill the queue as soon as one request completes, instead of draining each batch."""
    intra_op_parallelism: int = 1
    """Worker threads (each with its own AIO context); each request is split into this many slices."""
    use_direct_io: bool = True
    """O_DIRECT where the filesystem allows. False forces buffered pread/pwrite (for comparison, tests)."""

    def __post_init__(self) -> None:
        for name in ("single_submit", "overlap_events", "use_direct_io"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"aio.{name} must be true or false, got {getattr(self, name)!r}")
        for name, lo, hi in (
            ("block_size", IO_ALIGNMENT, 1 << 30),
            ("queue_depth", 1, MAX_QUEUE_DEPTH),
            ("intra_op_parallelism", 1, MAX_INTRA_OP_PARALLELISM),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"aio.{name} must be an integer, got {value!r}")
            if not lo <= value <= hi:
                raise ConfigError(f"aio.{name} must be between {lo} and {hi}, got {value}")
        if self.block_size % IO_ALIGNMENT:
            raise ConfigError(
                f"aio.block_size must be a multiple of {IO_ALIGNMENT} bytes for direct I/O, got {self.block_size}"
            )

    @property
    def loop(self) -> core.LoopSettings:
        return core.LoopSettings(
            block_size=self.block_size,
            queue_depth=self.queue_depth,
            single_submit=self.single_submit,
            overlap_events=self.overlap_events,
        )

    @property
    def staging_bytes(self) -> int:
        """Two halves (copy one while the other is in I/O), each holding a full queue of requests."""
        return 2 * max(MIN_STAGING_BYTES, self.block_size * self.queue_depth)


class _Worker:
    """One thread, its AIO context, and its staging buffer (made on first need)."""

    def __init__(self, index: int, settings: AioSettings) -> None:
        self.context = core.AioContext(settings.queue_depth)
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"infinity-aio-{index}")
        # Staged requests copy one half of the staging buffer while this thread does the other half's I/O.
        self.io_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"infinity-aio-{index}-io")
        self._staging_bytes = settings.staging_bytes
        self._staging: HostBuffer | None = None

    def staging(self) -> HostBuffer:
        if self._staging is None:
            self._staging = allocate_host_buffer(self._staging_bytes)
        return self._staging

    def close(self) -> None:
        self.executor.shutdown(wait=True)  # in-flight slices finish before their context goes
        self.io_thread.shutdown(wait=True)
        self.context.close()  # a no-op once quarantined: the kernel may still use the staging buffer
        if self._staging is not None and not self.context.quarantined:
            self._staging.release()
            self._staging = None


def _byte_view(tensor: torch.Tensor) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise InvalidTensorError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout is not torch.strided:
        raise InvalidTensorError(f"only dense (strided) tensors can be read or written, got {tensor.layout}")
    if not tensor.is_contiguous():
        raise InvalidTensorError(
            f"tensor of shape {tuple(tensor.shape)} with stride {tensor.stride()} is not contiguous; "
            "pass tensor.contiguous() (a copy) or read/write a contiguous buffer"
        )
    flat = tensor.detach().reshape(-1)
    return flat if flat.dtype is torch.uint8 else flat.view(torch.uint8)


def _copy_bytes(destination: torch.Tensor, source: torch.Tensor) -> None:
    """[Note: no OpenMP off the main thread]
    A worker thread copies host bytes with memmove (ctypes releases the GIL), not ``Tensor.copy_``: a torch op
    large enough for ``parallel_for`` run on a worker makes OpenMP start a team for that thread too. From then on
    libgomp manages more threads than there are CPUs, and it throttles the spin-wait of every team, the main
    thread's included (GOMP_SPINCOUNT's documented throttling): torch's intra-op workers sleep between parallel
    regions, and each region waits for them to wake. Measured with GPT-2 small at stage 3 on NVMe, on 2 cores:
    1.0-1.2 s of the CPUs' time idle a step against 0.27-0.36 with memmove, and torch's second thread busy
    1.05-1.15 s of a 1.8-1.9 s forward against 1.45-1.58. Device memory (a GPU tensor staged through the host)
    still copies with torch: its copies run no OpenMP. Both tensors are contiguous bytes of the same length."""
    if destination.numel() != source.numel():  # memmove would not notice
        raise ValueError(f"staged copy of {source.numel()} bytes into {destination.numel()}")
    if destination.device.type == "cpu" and source.device.type == "cpu":
        ctypes.memmove(destination.data_ptr(), source.data_ptr(), source.numel())
    else:
        destination.copy_(source)


def _plan_slices(nbytes: int, parallelism: int) -> list[tuple[int, int]]:
    """Contiguous (start, length) slices on 4 KiB boundaries, at most ``parallelism`` of them."""
    if nbytes == 0:
        return []
    piece = -(-nbytes // parallelism)
    piece = -(-piece // IO_ALIGNMENT) * IO_ALIGNMENT
    return [(start, min(piece, nbytes - start)) for start in range(0, nbytes, piece)]


class AioHandle:
    """Reads and writes tensors to files with asynchronous direct I/O.

    ``sync_*`` return the number of bytes moved; ``async_*`` queue the request and return at once;
    ``wait()`` blocks for every queued request, returns how many succeeded, and raises AioError
    (path, offset, errno) if any failed. Errors in the arguments or opening the file raise at call time.

    Wherever a path goes, an AioFile (``infinity.aio.open_file``) may go instead: the request borrows the
    descriptors it holds instead of opening and closing the file itself (see infinity/aio/files.py).

    ``submit_pread`` / ``submit_pwrite`` queue a request and return its AioRequest, to wait for alone
    (``request.wait()`` returns its bytes and raises its own error only). Only a closed or quarantined
    handle and bad arguments raise at call time; a file that cannot be opened, or is too short for the
    read, is that request's error. ``wait()`` also covers these, except those already waited for through
    their AioRequest (``wait()`` or ``exception()``): those are neither counted nor raised again.

    ``timeout_s`` (default: $INFINITY_AIO_TIMEOUT_S, else 300 s; ``math.inf`` for no limit) bounds each
    wait for a direct-I/O completion, so a stalled disk or a dead device cannot hang the process (and,
    in training, the ranks waiting on it). When it passes, the request raises AioTimeoutError (an
    AioError with errno ETIMEDOUT naming the path and the offset of the oldest request in flight).

    Note: after a timeout the kernel may still be moving bytes into or out of that request's memory, so
    the handle quarantines it: the AIO context is never destroyed (io_destroy would wait for the
    device) and the tensor or staging buffer is referenced for the life of the process, so its memory is
    never freed and reused. The tensor's contents (for a read) or the file's (for a write) are
    undefined. The handle then refuses every request with an AioError; make a new AioHandle.
    """

    def __init__(
        self,
        block_size: int = 1 << 20,
        queue_depth: int = 8,
        single_submit: bool = False,
        overlap_events: bool = True,
        intra_op_parallelism: int = 1,
        *,
        use_direct_io: bool = True,
        timeout_s: float | None = None,
    ) -> None:
        self.timeout_s = core.resolve_timeout_s(timeout_s)
        self.settings = AioSettings(
            block_size=block_size,
            queue_depth=queue_depth,
            single_submit=single_submit,
            overlap_events=overlap_events,
            intra_op_parallelism=intra_op_parallelism,
            use_direct_io=use_direct_io,
        )
        self._workers: list[_Worker] = []
        try:
            for index in range(intra_op_parallelism):
                self._workers.append(_Worker(index, self.settings))
        except BaseException:
            for worker in self._workers:
                worker.close()
            raise
        self._outstanding = _Outstanding()  # queued requests not yet waited for
        self._locked_buffers: dict[int, HostBuffer] = {}
        self._timed_out: AioTimeoutError | None = None  # set once: the handle is quarantined
        self._closer = weakref.finalize(self, _close_workers, self._workers)

    @classmethod
    def from_settings(cls, settings: AioSettings, *, timeout_s: float | None = None) -> AioHandle:
        return cls(
            settings.block_size,
            settings.queue_depth,
            settings.single_submit,
            settings.overlap_events,
            settings.intra_op_parallelism,
            use_direct_io=settings.use_direct_io,
            timeout_s=timeout_s,
        )

    # ---- DeepSpeed-compatible getters ----
    def get_block_size(self) -> int:
        return self.settings.block_size

    def get_queue_depth(self) -> int:
        return self.settings.queue_depth

    def get_single_submit(self) -> bool:
        return self.settings.single_submit

    def get_overlap_events(self) -> bool:
        return self.settings.overlap_events

    def get_intra_op_parallelism(self) -> int:
        return self.settings.intra_op_parallelism

    get_thread_count = get_intra_op_parallelism  # DeepSpeed's legacy name

    @property
    def backend(self) -> str:
        return core.BACKEND

    # ---- I/O ----
    def sync_pread(self, tensor: torch.Tensor, path, file_offset: int = 0) -> int:
        return self._submit(tensor, path, file_offset, is_write=False).wait()

    def sync_pwrite(self, tensor: torch.Tensor, path, file_offset: int = 0) -> int:
        return self._submit(tensor, path, file_offset, is_write=True).wait()

    def async_pread(self, tensor: torch.Tensor, path, file_offset: int = 0) -> None:
        self._outstanding.add(self._submit(tensor, path, file_offset, is_write=False))

    def async_pwrite(self, tensor: torch.Tensor, path, file_offset: int = 0) -> None:
        self._outstanding.add(self._submit(tensor, path, file_offset, is_write=True))

    def submit_pread(self, tensor: torch.Tensor, path, file_offset: int = 0) -> AioRequest:
        """Queue a read of ``tensor.nbytes`` bytes at ``file_offset`` into ``tensor``; wait on the result."""
        request = self._submit(tensor, path, file_offset, is_write=False, defer_file_errors=True)
        self._outstanding.add(request)
        return request

    def submit_pwrite(self, tensor: torch.Tensor, path, file_offset: int = 0) -> AioRequest:
        """Queue a write of ``tensor`` to ``path`` at ``file_offset``; wait on the result."""
        request = self._submit(tensor, path, file_offset, is_write=True, defer_file_errors=True)
        self._outstanding.add(request)
        return request

    def wait(self) -> int:
        """Block until every queued request not already waited for through its AioRequest is done.

        Returns how many of those succeeded; raises the first failure among them (by submission order),
        with a note of how many failed. Each request is reported once: by this or by its own wait."""
        requests = self._outstanding.take_all()
        reported = completed = 0
        failures: list[BaseException] = []
        for request in requests:
            request._done.wait()
            if not request._claim():  # its own wait() or exception() got there first
                continue
            reported += 1
            if request._error is None:
                completed += 1
            else:
                failures.append(request._error)
        if failures:
            first = failures[0]
            if reported > 1:  # the error names one request: say what became of the others
                _add_note(first, f"{len(failures)} of the {reported} requests failed; {completed} completed")
            raise first
        return completed

    @property
    def pending(self) -> int:
        """Requests queued and not yet waited for (by wait() or through their AioRequest)."""
        return len(self._outstanding)

    # ---- host buffers ----
    def new_cpu_locked_tensor(self, numel: int, dtype: torch.dtype | torch.Tensor = torch.uint8) -> torch.Tensor:
        """A 1-D tensor of ``numel`` elements in 2 MiB-aligned, huge-page-backed, locked (or pinned) memory.

        ``dtype`` may be an example tensor (DeepSpeed passes one). Free it with free_cpu_locked_tensor.
        """
        if isinstance(dtype, torch.Tensor):
            dtype = dtype.dtype
        if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
            raise ConfigError(f"numel must be a non-negative integer, got {numel!r}")
        itemsize = torch.empty((), dtype=dtype).element_size()
        buffer = allocate_host_buffer(numel * itemsize)
        tensor = buffer.view(numel, dtype)
        self._locked_buffers[tensor.data_ptr()] = buffer
        return tensor

    def free_cpu_locked_tensor(self, tensor: torch.Tensor) -> None:
        buffer = self._locked_buffers.pop(tensor.data_ptr(), None)
        if buffer is None:
            raise InvalidTensorError(
                "free_cpu_locked_tensor: this tensor was not made by new_cpu_locked_tensor "
                "of this handle, or was freed already"
            )
        buffer.release()

    def close(self) -> None:
        """Finish in-flight requests and destroy the AIO contexts. The handle is unusable after."""
        self._closer()
        for buffer in self._locked_buffers.values():
            buffer.release()
        self._locked_buffers.clear()

    def __enter__(self) -> AioHandle:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- internals: see [Note: request path] in the module docstring ----
    def _submit(
        self, tensor: torch.Tensor, path, file_offset: int, *, is_write: bool, defer_file_errors: bool = False
    ) -> AioRequest:
        """Queues the request's slices. ``path``: a path, or an AioFile whose descriptors it borrows.
        defer_file_errors: an open or file-size failure becomes the request's error (submit_*) instead of
        raising here (sync_*, async_*: DeepSpeed's behaviour)."""
        name = path.path if isinstance(path, AioFile) else str(path)
        if not self._closer.alive:
            raise AioError(op="submit", path=name, offset=file_offset, errno=None, detail="this AioHandle is closed")
        timed_out = self._timed_out
        if timed_out is not None:
            raise AioError(
                op="submit",
                path=name,
                offset=file_offset,
                errno=None,
                detail=(
                    f"this AioHandle is unusable: an earlier {timed_out.op} of {timed_out.path!r} at offset "
                    f"{timed_out.offset} timed out and may still be in flight, so its memory and AIO context "
                    "are kept for the life of the process; check the device and make a new AioHandle"
                ),
            )
        memory = _byte_view(tensor)
        if isinstance(file_offset, bool) or not isinstance(file_offset, int) or file_offset < 0:
            raise ConfigError(f"file_offset must be a non-negative integer, got {file_offset!r}")
        nbytes = memory.numel()
        aligned_offset = file_offset % IO_ALIGNMENT == 0
        direct = self.settings.use_direct_io and aligned_offset and nbytes >= IO_ALIGNMENT
        need_buffered = not direct or nbytes % IO_ALIGNMENT != 0 or memory.device.type != "cpu"
        request = AioRequest(
            op="write" if is_write else "read",
            path=name,
            offset=file_offset,
            tensor=tensor,
            memory=memory,
            outstanding=self._outstanding,
        )
        try:
            if isinstance(path, AioFile):  # it holds a buffered descriptor: need_buffered is met
                file = path._lend(is_write=is_write, direct=direct, offset=file_offset)
            else:
                file = open_for_io(path, is_write=is_write, direct=direct, need_buffered=need_buffered)
            if not is_write and file.is_regular and file.size < file_offset + nbytes:
                file.close()
                raise ShortTransferError(
                    op="read",
                    path=file.path,
                    offset=file_offset,
                    errno=None,
                    detail=(
                        f"the file has {file.size} bytes but this read needs {file_offset + nbytes} "
                        f"(offset {file_offset} + {nbytes} bytes of tensor): was it truncated, or written "
                        "from a smaller tensor?"
                    ),
                )
        except AioError as exc:
            if not defer_file_errors:
                raise
            request._fail(exc)
            return request
        request.path = file.path
        slices = _plan_slices(nbytes, self.settings.intra_op_parallelism)
        request._start(file, len(slices))
        for index, (worker, (start, length)) in enumerate(zip(self._workers, slices, strict=False)):
            try:
                worker.executor.submit(self._run_slice, worker, request, index, start, length)
            except RuntimeError:  # close() shut the executors down after the check above
                closed = AioError(
                    op=request.op, path=request.path, offset=file_offset + start, errno=None,
                    detail="this AioHandle was closed while the request was being queued",
                )  # fmt: skip
                request._slice_finished(index, closed)
        return request

    def _run_slice(self, worker: _Worker, request: AioRequest, index: int, start: int, length: int) -> None:
        try:
            self._transfer(worker, request, start, length)
        except BaseException as exc:  # the request's error: its waiters raise it
            if isinstance(exc, AioTimeoutError) and self._timed_out is None:
                self._timed_out = exc  # the first timeout is the one reported to later callers
            request._slice_finished(index, exc)
        else:
            request._slice_finished(index, None)

    def _transfer(self, worker: _Worker, request: AioRequest, start: int, length: int) -> None:
        file, memory = request.file, request.memory
        file_offset = request.offset + start
        on_host = memory.device.type == "cpu"
        direct_len = 0
        if file.direct_fd is not None and file_offset % IO_ALIGNMENT == 0:
            direct_len = length // IO_ALIGNMENT * IO_ALIGNMENT
        if direct_len:
            address = memory.data_ptr() + start
            if on_host and address % IO_ALIGNMENT == 0:
                core.rw_direct(
                    worker.context,
                    file.direct_fd,
                    is_write=request.is_write,
                    address=address,
                    nbytes=direct_len,
                    offset=file_offset,
                    settings=self.settings.loop,
                    path=file.path,
                    timeout_s=self.timeout_s,
                    keep_alive=memory,  # the user's tensor, if the kernel keeps it after a timeout
                )
            else:
                self._staged(worker, request, start, direct_len, direct=True)
        rest = length - direct_len
        if rest:
            if on_host:
                core.rw_buffered(
                    file.buffered_fd,
                    is_write=request.is_write,
                    address=memory.data_ptr() + start + direct_len,
                    nbytes=rest,
                    offset=file_offset + direct_len,
                    path=file.path,
                )
            else:
                self._staged(worker, request, start + direct_len, rest, direct=False)

    def _staged(self, worker: _Worker, request: AioRequest, start: int, length: int, *, direct: bool) -> None:
        """Moves memory[start:start+length] through the worker's aligned staging buffer.

        The buffer is used as two halves: while one half's I/O runs on the worker's I/O thread, this thread
        copies the next chunk into (writes) or out of (reads) the other half. Direct chunks are multiples of 4
        KiB."""
        staging = worker.staging()
        half = staging.nbytes // 2 // IO_ALIGNMENT * IO_ALIGNMENT
        halves = (staging.data[:half], staging.data[half : 2 * half])
        chunks = [(done, min(half, length - done)) for done in range(0, length, half)]

        def io(index: int):
            done, n = chunks[index]
            buffer = halves[index % 2]
            file_offset = request.offset + start + done
            if direct:
                core.rw_direct(
                    worker.context, request.file.direct_fd, is_write=request.is_write, address=buffer.data_ptr(),
                    nbytes=n, offset=file_offset, settings=self.settings.loop, path=request.path,
                    timeout_s=self.timeout_s, keep_alive=staging,
                )  # fmt: skip
            else:
                core.rw_buffered(
                    request.file.buffered_fd, is_write=request.is_write, address=buffer.data_ptr(), nbytes=n,
                    offset=file_offset, path=request.path,
                )  # fmt: skip

        def user(index: int) -> torch.Tensor:
            done, n = chunks[index]
            return request.memory[start + done : start + done + n]

        in_flight = None
        try:
            if request.is_write:
                for index in range(len(chunks)):
                    _copy_bytes(halves[index % 2][: chunks[index][1]], user(index))  # the other half may be in I/O
                    if in_flight is not None:
                        in_flight.result()
                    in_flight = worker.io_thread.submit(io, index)
                in_flight.result()
            else:
                in_flight = worker.io_thread.submit(io, 0)
                for index in range(len(chunks)):
                    in_flight.result()
                    in_flight = worker.io_thread.submit(io, index + 1) if index + 1 < len(chunks) else None
                    _copy_bytes(user(index), halves[index % 2][: chunks[index][1]])
        finally:
            if in_flight is not None:  # an error stopped the loop: never leave I/O running into our buffer
                in_flight.exception()


def _add_note(exc: BaseException, note: str) -> None:
    if hasattr(exc, "add_note"):
        exc.add_note(note)
    else:  # Python 3.10: the same attribute, which 3.11's tracebacks print
        exc.__notes__ = [*getattr(exc, "__notes__", []), note]


def _close_workers(workers: list[_Worker]) -> None:
    for worker in workers:
        worker.close()
