"""Stage 3 with the optimizer on NVMe and a gradient too large for host memory: the rank's reduced gradient lives
on NVMe too, tile by tile.

[Note: swapped gradients]
Without it the rank keeps its whole gradient shard in fp32 (4 bytes per element): on one rank as much as the
parameters themselves in fp32, and the one part of the training state that would still grow with the model in host
memory. Where a quarter of the rank's host share holds it, it stays there (the plan decides, on every rank alike:
``gradients_on_nvme`` in memory/plan.py), because on NVMe it costs 8 bytes of disk traffic per element and step, a
quarter of what the step moves: the same model on the same disk steps faster with it in memory. Here each optimizer
tile ([Note: tiles] in tiles.py) has a gradient segment in its own tier manager (a ring of tile-sized buffers as
deep as the optimizer's, a swap store beside the optimizer's). When a unit's gradient has been reduce-scattered, its
piece is cut along the unit's tiles: the first micro-step of an accumulation window writes each tile's part, later
ones read, add and write it back. The step reads each tile's gradient ahead together with its master and states.

What the step needs of the whole gradient is computed as the pieces arrive at the boundary's backward: each
unit piece's sum of squares (of the accumulated gradient, unscaled by the loss scale: for the global norm and
clipping), which is also fp16's overflow check: the sum is not finite exactly when an element is. The unscale
and clipping factors are applied per tile when it steps. The in-memory stage 3 path computes the same per-piece
squares and sums them in unit order, so clipping gives bitwise the same result with gradients in host memory or
on NVMe, whatever the tile size (a per-tile norm would round differently for every sub_group_size). With CUDA the
swapped piece is squared on the device (fp64) and the host's shard on the host (piece_squares): within ~1e-8.

[Note: bf16 gradients]
With ``infinity.offloaded_gradient_dtype`` "bf16" the segments hold the gradient in bf16: 2 bytes per element on
disk and 4 of disk traffic per step instead of 4 and 8, the compact states' companion where the disk is the
ceiling ([Note: compact states] in compact.py). The reduced piece arrives in fp32; it is rounded to nearest once
per micro-step (a later micro-step's piece is added in fp32 to the widened stored value and rounded again), and
widened to fp32 for the step, in a reused workspace, before the unscale and clipping factors apply. The norm is
taken at the boundary in fp32: of the piece before it is rounded with one micro-step a window, of the stored
(rounded) sum of the earlier ones plus the last piece with more. The step sees the gradient to bf16's 8 bits,
as with bf16 gradients in DeepSpeed's bf16 optimizer. Adam divides by the gradient's own running scale, so a
relative error of 2^-9 per element moves each update by about as much.
"""

from __future__ import annotations

import math

import torch

from infinity.memory.tiers import SegmentHandle, Tier, TierManager
from infinity.zero.tiles import Tile

GRADIENT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # infinity.offloaded_gradient_dtype
HOST_NORM_CHUNK = 1 << 15  # elements: the chunk's fp64 copy (256 KiB) comes from the C library's heap, reused
HOST_NORM_ROW = 64  # elements: one fp32 sum of squares each, the rows' sums added in fp64
HOST_NORM_BLOCK = HOST_NORM_ROW << 14  # elements a call: its rows' sums (64 KiB, 128 KiB in fp64) from the heap
DEVICE_NORM_CHUNK = 1 << 20  # elements: the caching allocator reuses the 8 MiB copy; one sync per piece


def piece_squares(grad: torch.Tensor) -> float:
    """A unit piece's share of the squared global norm, as both homes compute it. One fp32 reduction of a large
    piece is not enough: measured on 50M normal values, torch's fp32 vector_norm is 0.4% off (the lanes' partial
    sums outgrow fp32's precision), and an fp64 sum (chunks of HOST_NORM_CHUNK converted to fp64) takes 36-44 ms
    per 50M values: ~1 s of a steady step on a 1.24B-parameter model (py-spy). So on the host an fp32 piece of
    HOST_NORM_BLOCK elements or more is cut into rows of HOST_NORM_ROW elements, each row's norm taken in fp32 (a
    vectorized call per block) and the rows' squares added in fp64: 7 ms per 50M values, within 2.5e-9 of the fp64
    sum on 50M values spread over six decades (values under ~1e-19, whose fp32 squares are denormal or zero, are
    lost: far below what they add to a norm). fp32's own rounding is 6e-8; one row alone can be 1.7e-7 off, and
    longer rows more (1024: 1.8e-7 on 4096-element pieces, enough to move the clipping factor by an fp32 ulp and
    bf16 training off its reference); the rows' errors average out over a block's 16K rows. Smaller pieces, and
    other dtypes, are summed in fp64 chunks. Where the rows' sum is not finite (an element is not, or an fp32
    square overflowed), the piece is summed again in fp64, so the result is not finite exactly when an element is
    not (fp16's overflow check): an fp32 value's square never overflows fp64."""
    flat = grad.reshape(-1)
    if flat.device.type == "cpu":
        if flat.dtype == torch.float32 and flat.numel() >= HOST_NORM_BLOCK:
            total = _row_squares(flat)
            if math.isfinite(total):
                return total
        return _chunk_squares(flat)
    chunks = [torch.linalg.vector_norm(chunk, dtype=torch.float64) for chunk in flat.split(DEVICE_NORM_CHUNK)]
    return float(torch.stack(chunks).square().sum()) if chunks else 0.0


def _row_squares(flat: torch.Tensor) -> float:
    whole = flat.numel() // HOST_NORM_ROW * HOST_NORM_ROW
    total = 0.0
    for block in flat[:whole].split(HOST_NORM_BLOCK):
        norms = torch.linalg.vector_norm(block.view(-1, HOST_NORM_ROW), dim=1)
        wide = norms.double()
        total += float(wide.dot(wide))
    if whole < flat.numel():
        total += float(torch.linalg.vector_norm(flat[whole:], dtype=torch.float64)) ** 2
    return total


def _chunk_squares(flat: torch.Tensor) -> float:
    """fp64 accumulation a chunk at a time (no fp64 copy of a large piece: at 1M elements each chunk's 8 MiB copy
    was a fresh mapping, two page faults per page of gradient, measured on a 7M-element piece)."""
    total = 0.0
    for chunk in flat.split(HOST_NORM_CHUNK):
        total += float(torch.linalg.vector_norm(chunk, dtype=torch.float64)) ** 2
    return total


class SwappedGradients:
    """The rank's gradient, one NVMe segment per optimizer tile ([Note: swapped gradients])."""

    def __init__(self, tiles: list[Tile], manager: TierManager, *, unit_offsets: dict[int, int],
                 dtype: torch.dtype = torch.float32) -> None:  # fmt: skip
        """``unit_offsets``: where each unit's piece starts in the rank's flat shard (tiles are placed in it).
        ``dtype``: how the segments store the gradient ([Note: bf16 gradients])."""
        self.tiles = tiles
        self.manager = manager
        self.dtype = dtype
        self._by_unit: dict[int, list[Tile]] = {}
        for tile in tiles:
            self._by_unit.setdefault(tile.piece, []).append(tile)
            manager.add(self._name(tile), tile.numel, Tier.NVME, dtype)
        widest = max((tile.numel for tile in tiles), default=0) if dtype != torch.float32 else 0
        self._decoded = torch.empty(widest)  # the stepping tile's gradient in fp32, reused tile after tile
        self._unit_offsets = unit_offsets
        if tiles:
            manager.open()
        self.written: set[int] = set()  # tiles holding a gradient in this accumulation window
        self.squares: dict[int, float] = {}  # unit -> its piece's share, at the boundary
        self._boundary = False
        self._unscale = 1.0

    @staticmethod
    def _name(tile: Tile) -> str:
        return f"grad.{tile.name}"

    def begin_backward(self, *, boundary: bool, loss_scale: float) -> None:
        self._boundary = boundary
        self._unscale = 1.0 / loss_scale

    def deliver(self, unit: int, piece: torch.Tensor) -> None:
        """The unit's reduced piece of this micro-step (fp32): added to each of its tiles' gradients."""
        offset = self._unit_offsets[unit]
        tiles = self._by_unit.get(unit, ())
        if not tiles:
            return
        accumulated = piece  # at the boundary: the window's sum over the whole piece, for its norm
        if self._boundary and any(tile.index in self.written for tile in tiles):
            accumulated = piece.clone()
        for tile in tiles:
            first = tile.start - offset
            values = piece[first : first + tile.numel]
            if tile.index in self.written:
                handle = self.manager.acquire(self._name(tile))
                grad = handle.wait()
                grad.add_(values.to(grad.device))  # added in fp32, rounded once where stored in bf16
                if accumulated is not piece:
                    accumulated[first : first + tile.numel].copy_(grad)
            else:
                handle = self.manager.acquire(self._name(tile), read=False)
                handle.tensor.copy_(values)
                self.written.add(tile.index)
            self.manager.release(handle, dirty=True)
        if self._boundary:
            unscaled = accumulated if self._unscale == 1.0 else accumulated * self._unscale
            self.squares[unit] = piece_squares(unscaled)  # not finite where an element is (fp16's overflow)

    def acquire(self, tile: Tile, *, block: bool) -> SegmentHandle | None:
        """The tile's gradient for the step (zeros if it got none in this window)."""
        if tile.index in self.written:
            return self.manager.acquire(self._name(tile), block=block)
        handle = self.manager.acquire(self._name(tile), block=block, read=False)
        if handle is not None:
            handle.tensor.zero_()
        return handle

    def values(self, handle: SegmentHandle) -> torch.Tensor:
        """The tile's gradient in fp32, to step with and scale: the segment itself, or (bf16) its values widened
        into a workspace that is valid until the next tile's are taken."""
        stored = handle.wait()
        if stored.dtype == torch.float32:
            return stored
        decoded = self._decoded[: stored.numel()]
        decoded.copy_(stored)
        return decoded

    def release(self, handle: SegmentHandle) -> None:
        self.manager.release(handle, dirty=False)

    def zero(self) -> None:
        """A new accumulation window: the next pieces overwrite."""
        self.written.clear()
        self.squares = {}

    def close(self) -> None:
        self.manager.close()
