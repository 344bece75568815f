"""Where a rank's ZeRO-3 parameter shard lives: in device memory, in host memory, or on NVMe (offload_param).

[Note: unit shards]
The rank's shard is its piece of every unit, in the compute dtype ([Note: units] in units.py). Its home:
- DEVICE (no offload_param) and HOST (device cpu): one flat tensor; a unit's piece is a view of it. On the
  device it is the all-gather's input as it is; from host memory it is copied into the unit's own slot of the
  gathered buffer first (a pinned H2D copy where CUDA exists).
- NVME: each non-persistent unit's piece is a segment of the rank's parameter swap file (the tier manager,
  [Note: tiers] in memory/tiers.py); the persistent unit stays in memory (it is always gathered). A gather
  reads the piece into the unit's own slot of the gathered buffer (all-gather in place, input = that slot),
  from a staging buffer if the piece was read ahead (``stage``: the coordinator reads the next units of the
  trace ahead, into a ring of buffer_count buffers, never blocking), else straight from the disk. The ring's
  buffers fit the largest piece within ``staging_bytes`` / buffer_count (offload_param.buffer_size caps it
  too): a model's few outsized units (the embedding, ~30% of GPT-2 small) are read on demand, straight into
  their gathered buffer, rather than making every buffer their size.
After the optimizer step the updated pieces go back: ``edit(unit)`` gives a writable piece, ``commit(unit)``
writes it (asynchronously, behind the next tiles). Read-ahead copies are dropped at the end of every pass,
so a staged piece is never older than the one on disk.
"""

from __future__ import annotations

import torch

from infinity.memory.nvme_store import _human
from infinity.memory.tiers import SegmentHandle, Tier, TierManager
from infinity.zero.partition import GroupLayout


class UnitShards:
    def __init__(
        self,
        layout: GroupLayout,
        *,
        dtype: torch.dtype,
        device: torch.device,
        home: Tier,
        persistent: set[int],
        rank: int,
        manager: TierManager | None = None,
        max_piece_numel: int | None = None,
        staging_bytes: int = 256 << 20,
    ) -> None:
        self.layout = layout
        self.dtype = dtype
        self.device = device
        self.home = home
        self.rank = rank
        self.manager = manager
        self.flat: torch.Tensor | None = None
        self._resident: dict[int, torch.Tensor] = {}  # NVME home: the persistent unit's piece
        self._staged: dict[int, SegmentHandle] = {}
        self._editing: dict[int, SegmentHandle] = {}
        self._editing_outsized: dict[int, torch.Tensor] = {}
        if home is Tier.NVME:
            sizes = []
            for bucket in layout.buckets:
                if bucket.index in persistent:
                    self._resident[bucket.index] = torch.zeros(bucket.piece_numel, dtype=dtype, device=device)
                    continue
                manager.add(self._name(bucket.index), bucket.piece_numel, Tier.NVME, dtype)
                sizes.append(bucket.piece_numel * dtype.itemsize)
            if sizes:
                cap = staging_bytes // manager.buffer_count
                if max_piece_numel is not None:
                    cap = min(cap, max_piece_numel * dtype.itemsize)
                manager.buffer_bytes = max([n for n in sizes if n <= cap], default=cap)  # none fits: all on demand
            manager.open()
        else:
            where = device if home is Tier.DEVICE else torch.device("cpu")
            self.flat = torch.zeros(layout.shard_numel, dtype=dtype, device=where)
            if home is Tier.HOST and manager is not None and manager.pin_memory and torch.cuda.is_available():
                self.flat = self.flat.pin_memory()

    @staticmethod
    def _name(index: int) -> str:
        return f"unit{index}"

    def _span(self, index: int) -> slice:
        bucket = self.layout.buckets[index]
        return slice(bucket.shard_offset, bucket.shard_offset + bucket.piece_numel)

    # ---- gathering ----
    def on_device(self, index: int) -> torch.Tensor | None:
        """The piece itself when it lives on the compute device (use it as the all-gather input), else None."""
        if index in self._resident:
            return self._resident[index]
        if self.flat is not None and self.flat.device == self.device:
            return self.flat[self._span(index)]
        return None

    def load_into(self, index: int, out: torch.Tensor) -> None:
        """out <- the piece (blocking)."""
        if index in self._resident:
            out.copy_(self._resident[index])
        elif self.flat is not None:
            out.copy_(self.flat[self._span(index)], non_blocking=True)
        elif index in self._staged:
            handle = self._staged.pop(index)
            out.copy_(handle.wait())
            self.manager.release(handle, dirty=False)
        else:
            self.manager.read_into(self._name(index), out)

    def stage(self, index: int) -> bool:
        """Start reading the piece ahead (NVMe home); False when no staging buffer is free."""
        if self.flat is not None or index in self._resident or index in self._staged:
            return True
        if not self.manager.fits(self._name(index)):
            return True  # outsized: read on demand, straight into its gathered buffer
        handle = self.manager.acquire(self._name(index), block=False)
        if handle is None:
            return False
        self._staged[index] = handle
        return True

    def unstage_all(self) -> None:
        for handle in self._staged.values():
            self.manager.release(handle, dirty=False)
        self._staged.clear()

    @property
    def staging_capacity(self) -> int:
        return self.manager.buffer_count if self.manager is not None and self.flat is None else 0

    # ---- writing ----
    def store(self, index: int, values: torch.Tensor) -> None:
        """The piece <- values (building the units, an edit with GatheredParameters(modifier_rank=...))."""
        if index in self._staged:
            self.manager.release(self._staged.pop(index), dirty=False)
        if index in self._resident:
            self._resident[index].copy_(values)
        elif self.flat is not None:
            self.flat[self._span(index)].copy_(values)
        else:
            self.manager.write_from(self._name(index), values.to(device="cpu", dtype=self.dtype))

    def edit(self, index: int) -> torch.Tensor:
        """The piece, writable in place until ``commit(index)``."""
        if index in self._resident:
            return self._resident[index]
        if self.flat is not None:
            return self.flat[self._span(index)]
        if not self.manager.fits(self._name(index)):
            if index not in self._editing_outsized:
                self._editing_outsized[index] = self.read(index)
            return self._editing_outsized[index]
        if index not in self._editing:
            if index in self._staged:
                self.manager.release(self._staged.pop(index), dirty=False)
            self._editing[index] = self.manager.acquire(self._name(index))
        return self._editing[index].wait()

    def commit(self, index: int) -> None:
        outsized = self._editing_outsized.pop(index, None)
        if outsized is not None:
            self.manager.write_from(self._name(index), outsized)
        handle = self._editing.pop(index, None)
        if handle is not None:
            self.manager.release(handle, dirty=True)

    def describe(self) -> str:
        if self.flat is not None:
            return f"{self.home.value} {_human(self.flat.numel() * self.flat.element_size())}"
        return self.manager.describe()

    # ---- whole shard ----
    def read(self, index: int) -> torch.Tensor:
        """A copy of the piece on the host."""
        out = torch.empty(self.layout.buckets[index].piece_numel, dtype=self.dtype)
        self.load_into(index, out)
        return out

    def snapshot(self) -> torch.Tensor:
        """The whole shard, as a new host tensor (for tests and checkpoints)."""
        if self.flat is not None:
            return self.flat.detach().cpu().clone()
        self.manager.flush()
        out = torch.empty(self.layout.shard_numel, dtype=self.dtype)
        for bucket in self.layout.buckets:
            self.load_into(bucket.index, out[self._span(bucket.index)])
        return out

    def close(self) -> None:
        self._staged.clear()
        self._editing.clear()
        self._editing_outsized.clear()
        if self.manager is not None:
            self.manager.close()
