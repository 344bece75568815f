"""AioRequest: one queued read or write that can be waited for on its own.

Why: the offload pipelines overlap I/O with compute (the optimizer reads tile i+1 while tile i steps and
tile i-1 is written; stage 3 swaps parameters in ahead of the layer that needs them). They keep many
transfers in flight and must wait for one of them, and get that one's error, without waiting for (or
being failed by) the others. ``AioHandle.submit_pread`` / ``submit_pwrite`` return one of these.

How it completes: the handle splits a request into slices on its worker threads; the last slice to
finish closes the file (or gives an AioFile's descriptors back), records the first error by slice order,
sets a threading.Event (what waiters block on), and then drops the request's references to the tensor.
A request that fails before any I/O (the file cannot be opened, or is too short for the read) is
complete at once, with that error.

Who reports a request: the first to observe its outcome once it is complete claims it, either its own
``wait()`` / ``exception()`` or the handle-wide ``AioHandle.wait()``. The handle-wide wait counts and
raises only the requests it claimed, so a request waited for individually is never counted twice or
raised again there. The request's own ``wait()`` always reports its own outcome, however often called.
"""

from __future__ import annotations

import threading

import torch

from infinity.aio.files import OpenFile


class _Outstanding:
    """A handle's requests that nobody has claimed yet (what AioHandle.wait() will report)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._requests: dict[int, AioRequest] = {}  # by id(); dicts keep submission order

    def add(self, request: AioRequest) -> None:
        with self._lock:
            self._requests[id(request)] = request

    def discard(self, request: AioRequest) -> None:
        with self._lock:
            self._requests.pop(id(request), None)

    def take_all(self) -> list[AioRequest]:
        with self._lock:
            requests = list(self._requests.values())
            self._requests.clear()
        return requests

    def __len__(self) -> int:
        return len(self._requests)


class AioRequest:
    """One read or write queued on an AioHandle. ``op`` ("read" or "write"), ``path``, ``offset`` (in the
    file) and ``nbytes`` say what it moves. The tensor is referenced until the request is complete."""

    __slots__ = (
        "op", "path", "offset", "nbytes", "memory", "file",
        "_tensor", "_outstanding", "_lock", "_done", "_slices_left", "_errors", "_error", "_claimed",
    )  # fmt: skip

    def __init__(
        self,
        *,
        op: str,
        path: str,
        offset: int,
        tensor: torch.Tensor,
        memory: torch.Tensor,
        outstanding: _Outstanding | None = None,
    ) -> None:
        self.op = op
        self.path = path
        self.offset = offset
        self.nbytes = memory.numel()
        self.memory: torch.Tensor | None = memory  # flat uint8 view the workers move; None once complete
        self.file: OpenFile | None = None
        self._tensor: torch.Tensor | None = tensor  # the caller's tensor: alive while the kernel may use it
        self._outstanding = outstanding
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._slices_left = 0
        self._errors: list[BaseException | None] = []
        self._error: BaseException | None = None
        self._claimed = False

    # ---- public ----
    @property
    def is_write(self) -> bool:
        return self.op == "write"

    def done(self) -> bool:
        """True once the request has succeeded or failed. Never blocks."""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> int:
        """Block until this request is complete; return the bytes it moved (``nbytes``).

        Raises this request's own error (AioError, ShortTransferError, AioTimeoutError: naming its path
        and offset), never another request's. Waiting again returns or raises the same. If ``timeout``
        seconds pass first, raises the builtin TimeoutError; the request stays in flight and unclaimed."""
        exc = self.exception(timeout)
        if exc is not None:
            raise exc
        return self.nbytes

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """Block until complete like wait(); return this request's error, or None if it succeeded."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"{self!r} did not complete within {timeout} s; it is still in flight")
        self._claim()
        return self._error

    def __repr__(self) -> str:
        state = "in flight" if not self.done() else ("failed" if self._error is not None else "done")
        return f"AioRequest({self.op} of {self.path!r} at offset {self.offset}, {self.nbytes} bytes, {state})"

    # ---- for AioHandle ----
    def _start(self, file: OpenFile, slices: int) -> None:
        """Called before any slice is queued: the file is closed (or given back to its AioFile) when the last
        of ``slices`` finishes."""
        self.file = file
        self._slices_left = slices
        self._errors = [None] * slices
        if slices == 0:
            self._complete()

    def _slice_finished(self, index: int, error: BaseException | None) -> None:
        with self._lock:
            self._errors[index] = error
            self._slices_left -= 1
            last = self._slices_left == 0
        if last:
            self._complete()

    def _fail(self, error: BaseException) -> None:
        """Complete at once with ``error``: the request failed before any I/O was queued."""
        self._error = error
        self._complete()

    def _complete(self) -> None:
        if self.file is not None:
            self.file.close()
        if self._error is None:
            self._error = next((e for e in self._errors if e is not None), None)
        self._tensor = self.memory = None  # before set(): once wait() returns, nothing here pins the tensor
        self._done.set()

    def _claim(self) -> bool:
        """Marks the outcome as reported; True for the first caller only. Call once complete."""
        with self._lock:
            first = not self._claimed
            self._claimed = True
        if first and self._outstanding is not None:
            self._outstanding.discard(self)
        return first
