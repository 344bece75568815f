"""This rank's reduced fp32 gradient in memory: created by a window's first reduced piece, freed after the step
(or kept for the next window: [Note: gradient kept across steps]).

[Note: gradient shards]
Torch frees gradients after a step (``zero_grad(set_to_none=True)``) and FSDP2 frees its sharded ones: from the step
to the next backward no gradient memory exists, and the forward's activations peak in that gap. The reduced
gradient here does the same: one fp32 tensor per param group (stages 0-2) or for the whole flat shard (stage 3),
created empty when the accumulation window's first piece arrives. A region's first piece in a window is copied in,
later ones (stage 2 and 3 reduce every micro-step) are added; regions that got nothing are zeroed when the
gradient is read (``tensors()``); ``free()`` after the step, taken or skipped, gives the memory back. Empty, not
zeroed, so its pages are touched as pieces arrive in backward, while activations are being freed, not all at once
before it. Measured on GPT-2 124M (fp32, world size 1): the gradient held through forward was 0.46 GiB of a 4.7 GiB
peak. The one exception: at stage 3 with the optimizer on NVMe the step runs behind the next forward ([Note: step
behind forward] in unit_optimizer.py), so the gradient is freed (unless kept) when its last unit has stepped, late
in that forward: before its largest activations (the logits) are made, which take the freed blocks.

Where it lives: on the compute device, unless the optimizer is offloaded (host memory or NVMe): then the step reads
it in host memory, and on a GPU it would be the largest thing there, 4 bytes per element of the shard, twice the
16-bit parameters. So with offload_optimizer it is held in host memory (``gradient_device``), pinned when
offload_optimizer.pin_memory asks and CUDA exists, and each reduced piece is streamed into it as it is reduced, as
DeepSpeed does: copied device -> host on a side stream with an event ([Note: host copies] in memory/copies.py), the
device piece freed once the copy has read it; a later piece of the same region is copied into a pinned staging
buffer and added on the host once it has landed. The GPU holds only the pieces in flight, never the shard: at
most MAX_IN_FLIGHT copies are queued (a piece's memory is reused only once its copy has read it, so copies lagging
behind the reductions would hold more). The host reads the gradient only after every copy has landed
(``tensors()`` and ``free()`` wait). Unpinned, the copies block the host, as any copy into pageable memory does.
Pinned memory freed by the step stays in torch's pinned cache, which hands it to the next window. Without CUDA
the host is the compute device: nothing moves.

[Note: gradient kept across steps]
Freeing the gradient after the step pays where the forward's activations take its blocks. Where they are smaller
than it, the freed blocks mostly wait in the heap (KEEP keeps them, memory/host.py), and the next backward's
gradient, an aligned block of the same size, does not fit the hole it left (glibc before 2.38 asks for the size
plus the alignment), so the heap grows by the whole gradient once more. Measured on a 1.24B-parameter Llama shape
(everything on NVMe, sequence 64, world size 1: a 4.45 GiB gradient, 0.68 GiB of heap taken by the first
forward): peak RSS 13.5-13.9 GiB, the heap growing by 4.6 GiB in the second step's backward. So the first training
forward's heap growth is measured (``FirstForwardProbe``), and where the gradient, in plain host memory under KEEP,
is at least KEPT_GRADIENT_MIN_BYTES and larger than that growth, it stays allocated for the next window: each
window still copies its first piece of every region in and zeroes the regions that got none, so nothing of the
last window is read. Kept there, the same run peaked at 10.72 GiB. GPT-2 small (0.46 GiB gradient, 1.2 GiB of
activations) keeps freeing it: kept, its peak RSS rose 0.44 GiB with everything on NVMe. The decision reads the
heap, not glibc's version: where the hole would be reused, keeping costs nothing the forward needed. A policy
that leaves KEEP (the host running short) frees it again; empty_partition_cache and offload_states give it back
between windows. A custom optimizer that keeps ``p.grad`` itself without a copy would see it overwritten by the
next window (torch's copy what they keep).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from infinity.memory import host
from infinity.memory.copies import HostCopies
from infinity.zero.partition import GroupLayout

logger = logging.getLogger("infinity")

MAX_IN_FLIGHT = 4  # device -> host copies queued before backward waits for the oldest: the device pieces (and
# staging buffers) they hold stay bounded even when the copies lag behind the reductions
KEPT_GRADIENT_MIN_BYTES = 256 << 20  # a smaller gradient is freed after every step ([Note: gradient kept ...])


def keep_across_steps(gradient_bytes: int, activation_bytes: int) -> bool:
    """[Note: gradient kept across steps]: whether the gradient's blocks are worth more kept than freed."""
    return gradient_bytes >= KEPT_GRADIENT_MIN_BYTES and gradient_bytes > activation_bytes


def gradient_device(device: torch.device, *, offloaded: bool) -> torch.device:
    """Where the reduced gradient lives: the host when the optimizer steps there or on NVMe, else ``device``."""
    return torch.device("cpu") if offloaded else device


class GradientShards:
    def __init__(self, regions: Sequence[Sequence[tuple[int, int]]], numels: Sequence[int], device: torch.device,
                 *, pin_memory: bool = False):  # fmt: skip
        """``regions``: per group, the (offset, numel) of every piece a reduction writes; ``numels``: per group,
        the shard's elements (the regions tile it). ``device``: where the gradient lives (``gradient_device``);
        ``pin_memory``: in host memory, pinned where CUDA exists, so that pieces stream in."""
        self.regions = [list(group) for group in regions]
        self.numels = list(numels)
        self.device = device
        self.pinned = pin_memory and device.type == "cpu" and torch.cuda.is_available()
        self._tensors: list[torch.Tensor | None] = [None] * len(self.numels)
        self._written: set[tuple[int, int]] = set()  # (group, offset) written in this window
        self._complete = False  # every region written or zeroed since the last new region
        self._copies: HostCopies | None = None  # pieces from another device land through it
        self.kept_across_steps = False  # its tensors stay allocated for the next window ([Note: gradient kept ...])

    @classmethod
    def for_layouts(cls, layouts: Sequence[GroupLayout], device: torch.device, *,
                    pin_memory: bool = False) -> GradientShards:  # fmt: skip
        """One tensor per layout (param group, or stage 3's flat shard); a region per bucket piece."""
        regions = [[(b.shard_offset, b.piece_numel) for b in layout.buckets] for layout in layouts]
        return cls(regions, [layout.shard_numel for layout in layouts], device, pin_memory=pin_memory)

    @property
    def nbytes(self) -> int:
        """Bytes of the whole gradient once allocated."""
        return 4 * sum(self.numels)

    @property
    def has_pieces(self) -> bool:
        """A piece was written in this window (an earlier micro-step's, with gradient accumulation)."""
        return bool(self._written)

    @property
    def in_plain_host_memory(self) -> bool:
        """Held in unpinned host memory: the heap's (pinned blocks stay in torch's own cache)."""
        return self.device.type == "cpu" and not self.pinned

    @property
    def home(self) -> str:
        return "host" if self.device.type == "cpu" else "device"

    def _new(self, numel: int) -> torch.Tensor:
        return torch.empty(numel, dtype=torch.float32, device=self.device, pin_memory=self.pinned)

    def write(self, group: int, offset: int, piece: torch.Tensor) -> None:
        """Region (group, offset) <- piece, or += piece after its first piece of the window."""
        tensor = self._tensors[group]
        if tensor is None:
            tensor = self._tensors[group] = self._new(self.numels[group])
        target = tensor[offset : offset + piece.numel()]
        first = (group, offset) not in self._written
        if piece.device != target.device:  # reduced on the device, held in host memory
            self._land(target, piece, first=first)
        elif first:
            target.copy_(piece, non_blocking=True)
        else:
            target.add_(piece)
        if first:
            self._written.add((group, offset))
            self._complete = False

    def _land(self, target: torch.Tensor, piece: torch.Tensor, *, first: bool) -> None:
        """The piece streamed into host memory ([Note: gradient shards])."""
        if self._copies is None:
            self._copies = HostCopies(piece.device)
        if first:
            self._copies.copy(target, piece)
        else:
            staged = self._new(piece.numel())
            self._copies.copy(staged, piece, then=lambda target=target, staged=staged: target.add_(staged))
        self._copies.settle(block=True, keep=MAX_IN_FLIGHT)

    def _settle(self) -> None:
        if self._copies is not None:
            self._copies.settle(block=True)

    def tensors(self) -> list[torch.Tensor]:
        """The window's gradient per group, complete: regions that got no piece read as zeros."""
        self._settle()
        if self._complete:
            return self._tensors
        for group, numel in enumerate(self.numels):
            if self._tensors[group] is None:
                self._tensors[group] = self._new(numel)
            for offset, count in self.regions[group]:
                if (group, offset) not in self._written:
                    self._tensors[group][offset : offset + count].zero_()
                    self._written.add((group, offset))
        self._complete = True
        return self._tensors

    def free(self) -> None:
        """The window is over: its gradient is given back, or kept for the next window (``kept_across_steps``)."""
        self._written.clear()
        self._complete = False
        if not (self.kept_across_steps and host.keeps_freed_blocks()):  # under RETURN, freed blocks go back
            self.release()
        else:
            self._settle()

    def release(self) -> None:
        """Gives the gradient's memory back between windows (free, and for a kept one empty_partition_cache and
        offload_states); within a window, with pieces written, it stays."""
        if not self._written:
            self._settle()  # no copy may still be writing into the memory given back
            self._tensors = [None] * len(self.numels)

    def held_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors if t is not None)


class FirstForwardProbe:
    """Measures the first training forward's heap growth and decides whether the gradient is kept across steps
    ([Note: gradient kept across steps]); does nothing after that, or where it does not apply."""

    def __init__(self, shards: GradientShards | None) -> None:
        self.shards = shards
        self.decided = shards is None

    def begin(self) -> int | None:
        """Before a forward: the heap's bytes in use, where this forward is the one to measure."""
        if self.decided or not torch.is_grad_enabled():
            return None
        in_use = host.heap_in_use_bytes()
        if in_use is None or not (self.shards.in_plain_host_memory and host.keeps_freed_blocks()):
            self.decided = True
            return None
        return in_use

    def end(self, before: int) -> None:
        """After that forward: decides once."""
        self.decided = True
        after = host.heap_in_use_bytes()
        if after is None:
            return
        grown = max(after - before, 0)
        self.shards.kept_across_steps = keep_across_steps(self.shards.nbytes, grown)
        if self.shards.kept_across_steps:
            logger.info("the fp32 gradient (%.2f GiB) stays allocated between steps: the first forward took %.2f "
                        "GiB of heap, too little to reuse its blocks", self.shards.nbytes / 2**30, grown / 2**30)
