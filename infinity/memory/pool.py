"""Host buffers kept for reuse: memory the engine releases every step stays in the process, within a budget.

[Note: buffer reuse]
A stage-3 unit's gathered buffer is released after its use and gathered again at the next: with the storage
resized to 0 bytes and back (FSDP2's technique), every gather on the host asks the C library for fresh memory,
which for a block over its mmap threshold is a new mapping the kernel faults in page by page: one minor fault per
4 KiB the gather writes (measured: ~2 M faults and ~3 s of system time per GPT-2-small step). Here the storage
keeps its identity (views autograd saved in forward still see the values in backward) but its bytes come from
a pool: ``fill`` swaps a kept buffer's memory into it, ``empty`` swaps the memory out and keeps it, so a unit
gathered again reuses pages already mapped. The pool keeps at most ``budget_bytes`` in use and kept together
(the coordinator's live limit), so what it keeps is what the step's peak held anyway; beyond it memory goes back.

Only on the host: a CUDA allocator already caches. Where torch lacks the storage swap, the pool resizes (the old
behaviour, correct but faulting).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

_CAN_SWAP = hasattr(torch.UntypedStorage, "_swap_data_ptr_")


def gathered_units_numel(*, total: int, largest: int, max_live: int) -> int:
    """Elements of stage 3's gathered units at most, kept buffers included: the coordinator holds at most
    max_live_parameters (at least the largest unit, gathered whatever the limit), and the pool keeps one unit more,
    so that when units of other sizes (an embedding, a head) were live the block-sized ones still find theirs."""
    return min(total, max(max_live, largest) + largest)


def stage3_gradient_numel(
    *, persistent: int, units: list[int], reduce_bucket_numel: int, overlap_comm: bool, world_size: int
) -> int:
    """Elements of stage 3's fp32 gradient buckets held at once (zero/reducer.py, [Note: launch order]), their
    reduced pieces included: the persistent unit's (filled all through backward), the unit whose gradients are
    arriving, and those being reduced (with overlap_comm at world size > 1 up to reduce_bucket_size elements, at
    least one unit, while peers catch up; else one unit), with the pieces they and the persistent unit reduce into
    (at world size 1 a bucket is its own piece). The reducer keeps buffers for reuse within this many, as the
    estimate counts."""
    largest = max(units, default=0)
    reducing = largest
    if overlap_comm and world_size > 1:
        reducing = min(sum(units), max(reduce_bucket_numel, largest))
    pieces = (-(-reducing // world_size) + -(-persistent // world_size)) if world_size > 1 else 0
    return persistent + largest + reducing + pieces


@dataclass(slots=True)
class PoolStats:
    made: int = 0  # buffers allocated
    reused: int = 0  # fills served from a kept buffer
    dropped: int = 0  # buffers handed back (over the budget, or to make room for another size)
    peak_bytes: int = 0  # most bytes in use and kept at once


@dataclass(eq=False)
class StoragePool:
    """Buffers of exact byte sizes for storages that are filled and emptied again and again ([Note: buffer
    reuse]). ``budget_bytes``: in use plus kept, at most; a fill beyond it still gets memory (the caller bounds
    what is live), and its buffer is not kept when emptied."""

    budget_bytes: int
    stats: PoolStats = field(default_factory=PoolStats)
    _kept: dict[int, list[torch.UntypedStorage]] = field(default_factory=dict)
    _kept_bytes: int = 0
    _in_use_bytes: int = 0
    _holders: list[torch.UntypedStorage] = field(default_factory=list)  # 0-byte storages, to swap memory into

    @property
    def kept_bytes(self) -> int:
        return self._kept_bytes

    @property
    def in_use_bytes(self) -> int:
        return self._in_use_bytes

    def fill(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        """``storage`` (0 bytes, on the host) gets ``nbytes`` of memory, a kept buffer's where one fits."""
        if not _CAN_SWAP or storage.device.type != "cpu":
            storage.resize_(nbytes)
            return
        kept = self._kept.get(nbytes)
        if kept:
            buffer = kept.pop()
            self._kept_bytes -= nbytes
            self.stats.reused += 1
        else:
            self._make_room(nbytes)
            buffer = torch.UntypedStorage(nbytes)
            self.stats.made += 1
        storage._swap_data_ptr_(buffer)  # storage now holds the memory, buffer the 0 bytes
        self._holders.append(buffer)  # the next empty() swaps into it ([Note: no allocation per gather] in units.py)
        self._in_use_bytes += nbytes
        self.stats.peak_bytes = max(self.stats.peak_bytes, self._in_use_bytes + self._kept_bytes)

    def empty(self, storage: torch.UntypedStorage) -> None:
        """``storage`` holds 0 bytes after; its memory is kept for the next fill of its size, within budget."""
        nbytes = storage.nbytes()
        if not _CAN_SWAP or storage.device.type != "cpu":
            storage.resize_(0)
            return
        if nbytes == 0:
            return
        holder = self._holders.pop() if self._holders else torch.UntypedStorage(0)
        storage._swap_data_ptr_(holder)  # holder now holds the memory
        self._in_use_bytes -= nbytes
        if self._in_use_bytes + self._kept_bytes + nbytes <= self.budget_bytes:
            self._kept.setdefault(nbytes, []).append(holder)
            self._kept_bytes += nbytes
        else:
            self.stats.dropped += 1

    def _make_room(self, nbytes: int) -> None:
        """Before a new buffer: kept ones of other sizes go back until in use, kept and new fit the budget."""
        for size in sorted(self._kept, reverse=True):
            buffers = self._kept[size]
            while buffers and self._in_use_bytes + self._kept_bytes + nbytes > self.budget_bytes:
                buffers.pop()
                self._kept_bytes -= size
                self.stats.dropped += 1
        self._kept = {size: buffers for size, buffers in self._kept.items() if buffers}

    def clear(self) -> None:
        """Every kept buffer goes back (the engine closes)."""
        self.stats.dropped += sum(len(buffers) for buffers in self._kept.values())
        self._kept.clear()
        self._kept_bytes = 0
        self._holders.clear()
