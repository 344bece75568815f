"""Stage-in of offloaded parameter pieces on a side stream where the compute device is CUDA.

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
it was not read ahead) takes the I/O engine's own bounce path instead. Unverified on a GPU so far: the checks are in
tests/gpu (``benchmarks/gpu/run_checks.sh``); watch ``torch.cuda.max_memory_reserved`` there, since memory marked
with record_stream is reused only once the compute stream has caught up. Without CUDA every call here is the plain
copy of the calling thread, and the rest does nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

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

    def copy(self, out: torch.Tensor, source: torch.Tensor, *, then_reuse_source: bool = False) -> None:
        """out <- source. ``then_reuse_source``: the caller gives the source's memory to something else right after
        (a ring buffer), so this returns when the copy has finished (on the side stream alone)."""
        pinned = out.device.type == "cuda" and source.device.type == "cpu" and source.is_pinned()
        out.copy_(source, non_blocking=pinned)
        if pinned and then_reuse_source:
            torch.cuda.current_stream(out.device).synchronize()  # inside side(): the side stream

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
