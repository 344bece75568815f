"""Copies between host and device memory on side streams where the compute device is CUDA, each followed by an event.

[Note: copy stream]
A unit's gather with offload_param moves the rank's piece host -> device (from a pinned staging buffer, the pinned
host home, or a piece the step just wrote) and then all-gathers it. On the compute stream that copy would wait for
every kernel queued before it, and the host, which must wait for the copy before its staging buffer goes back to
the ring, would wait for all of them too. So with CUDA the unit's gathered buffer is allocated on a side stream
(the caching allocator ties it to that stream), the copy runs there (non-blocking from pinned memory) and the
all-gather is launched there; an event recorded after them is what the compute stream waits for when the unit's
parameters attach, and the buffer is marked as used by the compute stream (``record_stream``) so that its memory is
not handed out again while compute kernels may still read it. A staging buffer goes back to the ring once the side
stream is done with it: a wait on the side stream's queue (the copy, and collectives queued there before it), not
on the queued compute. A buffer that exists already (the persistent unit, regathered after each step) is written
only after the compute stream's queued work. A piece read from NVMe straight into device memory (on demand, when
it was not read ahead) takes the I/O engine's own bounce path instead. Checked on a GPU by tests/gpu
(``benchmarks/gpu/run_checks.sh``); watch ``torch.cuda.max_memory_reserved`` there, since memory marked with
record_stream is reused only once the compute stream has caught up. Without CUDA every call here is the plain copy
of the calling thread, and the rest does nothing.

[Note: host copies]
A non-blocking copy out of (or into) pinned host memory returns before the bytes have moved; the host memory must
not be written (or read) by the host until the copy has finished. Nothing else orders the two: the compute stream
waiting for the copy says nothing to the host, and a sync that happens to come later (a ``.item()`` in the norm)
is an accident of today's step, not a guarantee. So every such copy returns an event, and whoever lets the host
touch the memory next waits for it: a host piece of a unit (host home, or kept by max_in_cpu) is copied to the
device at each gather and rewritten in place by the optimizer step, which waits for the copy's event first
(``UnitShards.edit`` and ``store`` in zero/shards.py). Device -> host copies (``HostCopies``: the reduced
gradient streamed to pinned host memory, [Note: gradient shards] in zero/gradient_shards.py) run on a side
stream of their own, after the compute stream's work so far (the reduction that produced the source); the source
is marked as used by that stream so that its memory is not reused before the copy has read it, and the host reads
the destination only after the copy's event (``settle``). What must happen once a copy has landed (adding a piece
to the gradient) is queued with it and run by ``settle``, in the order the copies were made: copies on one stream
finish in that order.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable, Iterator

import torch


class CopyStream:
    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device=device) if device.type == "cuda" and torch.cuda.is_available() else None

    @contextlib.contextmanager
    def side(self, *, after_compute: bool = False) -> Iterator[None]:
        """Allocations, copies and collectives inside run on the side stream (CUDA). Only for pieces coming from
        host memory: a piece already on the device is gathered on the compute stream, which wrote it. No wait for
        the compute stream, since the sources are host memory the host has finished writing and the destination
        is allocated here, unless ``after_compute``: the destination already exists (compute may still use it)."""
        if self.stream is None:
            yield
            return
        if after_compute:
            self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        with torch.cuda.stream(self.stream):
            yield

    def copy(self, out: torch.Tensor, source: torch.Tensor, *, then_reuse_source: bool = False):
        """out <- source. ``then_reuse_source``: the caller gives the source's memory to something else right after
        (a ring buffer), so this returns when the copy has finished (on the side stream alone). Otherwise a copy
        from pinned memory returns at once with its event: the host waits for it before it writes the source again
        ([Note: host copies]). None: the copy has finished already."""
        pinned = out.device.type == "cuda" and source.device.type == "cpu" and source.is_pinned()
        out.copy_(source, non_blocking=pinned)
        if not pinned:
            return None
        if then_reuse_source:
            torch.cuda.current_stream(out.device).synchronize()  # inside side(): the side stream
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(out.device))
        return event

    def record(self) -> torch.cuda.Event | None:
        """An event after the side stream's work so far (call inside ``side()``)."""
        if self.stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def join(self, event: torch.cuda.Event | None, buffer: torch.Tensor) -> None:
        """The compute stream waits for ``event``; ``buffer`` (allocated on the side stream) is in use by it."""
        if event is None:
            return
        compute = torch.cuda.current_stream(buffer.device)
        compute.wait_event(event)
        buffer.record_stream(compute)


class HostCopies:
    """Device -> host copies into pinned memory on a side stream, each with an event ([Note: host copies])."""

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device=device) if device.type == "cuda" and torch.cuda.is_available() else None
        self._landing: deque[tuple[torch.cuda.Event, Callable[[], None] | None]] = deque()

    def copy(self, out: torch.Tensor, source: torch.Tensor, *, then: Callable[[], None] | None = None) -> None:
        """out (host) <- source (device), queued behind the compute stream's work so far; ``then()`` runs on the
        host once it has landed (``settle``). Without a pinned destination or CUDA: a plain copy, and ``then()``
        at once."""
        if self.stream is None or not out.is_pinned() or source.device.type != "cuda":
            out.copy_(source)
            if then is not None:
                then()
            return
        self.stream.wait_stream(torch.cuda.current_stream(source.device))
        with torch.cuda.stream(self.stream):
            out.copy_(source, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        source.record_stream(self.stream)  # its memory is not reused before the copy has read it
        self._landing.append((event, then))

    def settle(self, *, block: bool, keep: int = 0) -> None:
        """Runs what follows the copies that have landed, in order; ``block``: waits until at most ``keep`` are
        left in flight."""
        while self._landing:
            event, then = self._landing[0]
            if not event.query():
                if not block or len(self._landing) <= keep:
                    return
                event.synchronize()
            self._landing.popleft()
            if then is not None:
                then()

    @property
    def in_flight(self) -> int:
        return len(self._landing)
