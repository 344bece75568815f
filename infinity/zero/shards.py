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
  their gathered buffer, rather than making every buffer their size. The step writes an outsized piece behind
  it and keeps it (within ``staging_bytes``, the first the step commits, in the units' order) for the next
  forward, whose gather takes it from memory: GPT-2's embedding is the forward's first unit.
- NVME with offload_param.max_in_cpu: a fixed set of non-persistent pieces stays in host memory in front of the
  disk (``host_kept``: along the units' order, every piece that keeps the running total within the cap). They
  are home-HOST segments of the tier manager (pinned when pin_memory and CUDA exist, counted in its stats) and
  behave like the persistent piece: gathered straight from memory, edited in place, never written to NVMe, never
  staged, so the ring is sized from the NVMe pieces alone. Static, not LRU: every step reads every unit in the
  same cyclic order (forward, then backward), and LRU over a cyclic scan larger than the cache evicts each unit
  just before its next use and misses on every access; a fixed subset hits on all of its units. The cap is
  max_in_cpu elements of this rank's pieces, at most what a quarter of the rank's share of the node's host
  memory holds ([Note: one plan] in memory/plan.py), so the default (1e9) keeps small models wholly in memory
  without exhausting RAM on large ones; 0 sends every piece to NVMe. Which pieces stay, and the ring's buffer
  size, are the plan's (``place_parameters``), so `infinity estimate` counts what this keeps.
After the optimizer step the updated pieces go back: ``edit(unit)`` gives a writable piece, ``commit(unit)``
writes it (asynchronously, behind the next tiles). Where the step reads the pieces (split masters), it stages
the next units' pieces as it goes (an outsized one into the host buffer its edit takes, one at a time), and
``edit`` takes a staged read as it is; a step that fails gives back what it staged. Read-ahead copies are dropped at
the end of every pass, so a staged piece is never older than the one on disk.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from infinity.aio.handle import AioSettings
from infinity.comm import Comm
from infinity.config import ZeroConfig
from infinity.errors import StatesOffloadedError
from infinity.memory.copies import CopyStream
from infinity.memory.nvme_store import _human
from infinity.memory.offload import parameter_tier
from infinity.memory.plan import STAGING_BUDGET_BYTES, Plan, host_kept, outsized_spare_bytes, place_parameters
from infinity.memory.tiers import SegmentHandle, Tier, TierManager
from infinity.zero.partition import GroupLayout

__all__ = ["UnitShards", "host_kept", "parameter_shards"]


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
        staging_bytes: int = STAGING_BUDGET_BYTES,
        host_numel: int = 0,
    ) -> None:
        """``host_numel`` (NVME home): elements of non-persistent pieces kept in host memory (max_in_cpu)."""
        self.layout = layout
        self.dtype = dtype
        self.device = device
        self.home = home
        self.rank = rank
        self.manager = manager
        self.copies = CopyStream(device)  # host -> device stage-in ([Note: copy stream])
        self._copying: dict[int, torch.cuda.Event] = {}  # unit -> the copy still reading its host piece ([Note:
        # host copies] in memory/copies.py): waited for before the host writes the piece
        self.flat: torch.Tensor | None = None
        # NVME home: the pieces in memory, gathered and edited in place: the persistent unit's (on the device)
        # and those max_in_cpu keeps (in host memory)
        self._resident: dict[int, torch.Tensor] = {}
        self.parked = False  # offload_states moved the pieces' memory away ([Note: parking] in memory/parking.py)
        self.host_cap = host_numel
        self.kept: frozenset[int] = frozenset()  # NVME home: the units whose pieces max_in_cpu keeps in memory
        self.on_nvme: tuple[int, ...] = ()
        self._staged: dict[int, SegmentHandle] = {}
        self.read_ahead = 0  # reads ``stage`` started (zero_stats)
        self._editing: dict[int, SegmentHandle] = {}
        self._editing_outsized: dict[int, torch.Tensor] = {}
        # outsized pieces the step just wrote (asynchronously): the next gather takes them from here, not the disk;
        # at most staging_bytes of them, the first ones the step commits (the units' order, as the forward's)
        self._fresh: dict[int, torch.Tensor] = {}
        self.fresh_budget = staging_bytes
        # outsized pieces' host buffers, reused by the next step's edits rather than handed back and faulted in
        # again ([Note: buffer reuse] in memory/pool.py): spares (a piece takes the smallest that holds it), and
        # those whose write behind the step may still be reading them; spares within outsized_spare_budget
        self._outsized_spares: list[torch.Tensor] = []
        self._outsized_behind: dict[int, torch.Tensor] = {}
        self.outsized_spare_budget = 0
        self.outsized_made = 0  # such buffers allocated rather than reused, since the start (zero_stats)
        # while a step runs behind the forward ([Note: step behind forward] in unit_optimizer.py): steps a unit's
        # tiles (writing its piece) before the piece is used, and says whether a unit is still to step
        self.before_use: Callable[[int], None] | None = None
        self.is_pending: Callable[[int], bool] | None = None
        self.version = 0  # counts writes (store, edit, commit): a copy taken at one version is current until it moves
        # an outsized piece read ahead for the step's edit (split masters): its buffer and the read in flight
        self._reading: dict[int, tuple[torch.Tensor, object]] = {}
        if home is Tier.NVME:
            movable = [(b.index, b.piece_numel) for b in layout.buckets if b.index not in persistent]
            placement = place_parameters(movable, itemsize=dtype.itemsize, host_numel=host_numel,
                                         staging_bytes=staging_bytes, buffer_count=manager.buffer_count,
                                         max_piece_numel=max_piece_numel)  # fmt: skip
            self.kept, self.on_nvme = placement.kept, placement.on_nvme
            for bucket in layout.buckets:
                if bucket.index in persistent:
                    self._resident[bucket.index] = torch.zeros(bucket.piece_numel, dtype=dtype, device=device)
                else:
                    tier = Tier.HOST if bucket.index in self.kept else Tier.NVME
                    manager.add(self._name(bucket.index), bucket.piece_numel, tier, dtype)
            if self.on_nvme:
                manager.buffer_bytes = placement.buffer_bytes  # none fits: all read on demand
            outsized = [n * dtype.itemsize for i, n in movable if i in self.on_nvme and not manager.fits(self._name(i))]
            self.outsized_spare_budget = outsized_spare_bytes(outsized, staging_bytes)
            manager.open()
            for index in self.kept:  # the manager's host home (pinned where asked), used in place from here on
                self._resident[index] = manager.acquire(self._name(index)).wait()
        else:
            where = device if home is Tier.DEVICE else torch.device("cpu")
            pin = home is Tier.HOST and manager is not None and manager.pin_memory and torch.cuda.is_available()
            self.flat = torch.zeros(layout.shard_numel, dtype=dtype, device=where, pin_memory=pin)  # pinned as made:
            # no second copy of the shard

    def _before_use(self, index: int) -> None:
        """A step running behind the forward steps the unit's tiles before its piece is used."""
        if self.before_use is not None:
            self.before_use(index)

    @staticmethod
    def _name(index: int) -> str:
        return f"unit{index}"

    def _span(self, index: int) -> slice:
        bucket = self.layout.buckets[index]
        return slice(bucket.shard_offset, bucket.shard_offset + bucket.piece_numel)

    # ---- gathering ----
    def on_device(self, index: int) -> torch.Tensor | None:
        """The piece itself when it lives on the compute device (use it as the all-gather input), else None."""
        self._check_here()
        self._before_use(index)
        piece = self._resident.get(index)
        if piece is None and self.flat is not None:
            piece = self.flat[self._span(index)]
        return piece if piece is not None and piece.device == self.device else None

    def load_into(self, index: int, out: torch.Tensor) -> None:
        """out <- the piece. With CUDA, inside ``copies.side()`` the copy is queued on the side stream ([Note: copy
        stream] in memory/copies.py); a staging buffer goes back to the ring when it has been copied."""
        self._check_here()
        self._before_use(index)
        if index in self._resident or self.flat is not None:
            source = self._resident[index] if index in self._resident else self.flat[self._span(index)]
            event = self.copies.copy(out, source)
            if event is not None:  # a non-blocking copy from the host piece, which the step rewrites in place
                self._copying[index] = event
        elif index in self._reading:  # read ahead for the step's edit: taken from there, then a spare
            piece = self._landed(index)
            self.copies.copy(out, piece, then_reuse_source=True)
            self._spare(piece)
            self._recycle_outsized()
        elif index in self._fresh:  # its write may still be reading it: reused once that has landed
            piece = self._fresh.pop(index)
            self.copies.copy(out, piece, then_reuse_source=True)
            self._outsized_behind[index] = piece
            self._recycle_outsized()
        elif index in self._staged:
            handle = self._staged.pop(index)
            self.copies.copy(out, handle.wait(), then_reuse_source=True)
            self.manager.release(handle, dirty=False)
        elif (written := self.manager.being_written(self._name(index))) is not None:
            self.copies.copy(out, written, then_reuse_source=True)  # the step just wrote it: no read back
        else:
            self.manager.read_into(self._name(index), out)

    def stage(self, index: int, *, for_edit: bool = False) -> bool:
        """Start reading the piece ahead (NVMe home); False when no staging buffer is free. An outsized piece is
        read on demand, straight into its gathered buffer; ``for_edit`` (the step's edits that read the piece
        first): into the host buffer its edit takes, one such piece at a time."""
        if self.flat is not None or index in self._resident or index in self._staged:
            return True
        if self.is_pending is not None and self.is_pending(index):
            return True  # its step writes the piece, which its gather then takes from memory
        if not self.manager.fits(self._name(index)):
            if for_edit and not self._reading and index not in self._fresh and index not in self._editing_outsized:
                piece = self._outsized_buffer(self.layout.buckets[index].piece_numel)
                self._reading[index] = (piece, self.manager.start_read(self._name(index), piece))
            return True
        handle = self.manager.acquire(self._name(index), block=False)
        if handle is None:
            return False
        self._staged[index] = handle
        self.read_ahead += 1
        return True

    def unstage_all(self) -> None:
        for handle in self._staged.values():
            self.manager.release(handle, dirty=False)
        self._staged.clear()
        try:
            self._drop_reading()
        finally:
            self._drop_fresh()

    def _landed(self, index: int) -> torch.Tensor:
        """The outsized piece read ahead, once its read has landed."""
        piece, request = self._reading.pop(index)
        self.manager.finish_read(self._name(index), request)
        return piece

    def _drop_reading(self, index: int | None = None) -> None:
        """Outsized pieces read ahead and not taken: their buffers become spares once the reads have landed."""
        for unit in list(self._reading) if index is None else [index] if index in self._reading else []:
            self._spare(self._landed(unit))
        if self.manager is not None:
            self._recycle_outsized()

    def _drop_fresh(self, index: int | None = None) -> None:
        for unit in list(self._fresh) if index is None else [index] if index in self._fresh else []:
            self._outsized_behind[unit] = self._fresh.pop(unit)  # reused once its write has landed
        if self.manager is not None:
            self._recycle_outsized()

    def _outsized_buffer(self, numel: int) -> torch.Tensor:
        """A host buffer for an outsized piece's edit: a spare of its size, or a new one."""
        self._recycle_outsized()
        fitting = [k for k, spare in enumerate(self._outsized_spares) if spare.numel() >= numel]
        if fitting:
            best = min(fitting, key=lambda k: self._outsized_spares[k].numel())
            return self._outsized_spares.pop(best)[:numel]
        self.outsized_made += 1
        return torch.empty(numel, dtype=self.dtype)

    def _spare(self, piece: torch.Tensor) -> None:
        """An outsized piece's buffer is free: the whole buffer it is a view of becomes a spare."""
        self._outsized_spares.append(piece if piece._base is None else piece._base)

    def _recycle_outsized(self) -> None:
        """Buffers whose write has landed become spares (the whole buffer a piece had a view of), within
        outsized_spare_budget, the smallest going back first; the rest go back to the C library."""
        self.manager.reap_loose_writes()
        for index in [i for i in self._outsized_behind if not self.manager.writing(self._name(i))]:
            buffer = self._outsized_behind.pop(index)
            self._spare(buffer)
        self._outsized_spares.sort(key=torch.Tensor.numel, reverse=True)
        kept = 0
        for position, spare in enumerate(self._outsized_spares):
            kept += spare.numel() * spare.element_size()
            if kept > self.outsized_spare_budget:
                del self._outsized_spares[position:]
                break

    def drop_spares(self) -> None:
        """Outsized pieces' spare buffers go back (a checkpoint's transfers are next); the next step makes them."""
        self._outsized_spares.clear()

    def _fresh_bytes(self) -> int:
        return sum(piece.untyped_storage().nbytes() for piece in self._fresh.values())  # a view holds its base

    @property
    def staging_capacity(self) -> int:
        return self.manager.buffer_count if self.on_nvme else 0

    # ---- writing ----
    def _copied(self, index: int) -> None:
        """Before the host writes a host piece in place: the copy still reading it has finished ([Note: host
        copies] in memory/copies.py)."""
        event = self._copying.pop(index, None)
        if event is not None:
            event.synchronize()

    def store(self, index: int, values: torch.Tensor) -> None:
        """The piece <- values (building the units, an edit with GatheredParameters(modifier_rank=...))."""
        self._check_here()
        self._before_use(index)
        self._copied(index)
        self.version += 1
        if index in self._staged:
            self.manager.release(self._staged.pop(index), dirty=False)
        self._drop_reading(index)
        self._drop_fresh(index)
        if index in self._resident:
            self._resident[index].copy_(values)
        elif self.flat is not None:
            self.flat[self._span(index)].copy_(values)
        else:
            self.manager.write_from(self._name(index), values.to(device="cpu", dtype=self.dtype))

    def edit(self, index: int, *, overwrite: bool = False) -> torch.Tensor:
        """The piece, writable in place until ``commit(index)``. ``overwrite``: the caller writes every element
        of the piece that holds a parameter, so an NVMe piece is not read first (its padding is zeroed)."""
        self._check_here()
        self._before_use(index)
        self._copied(index)
        self.version += 1
        if index in self._resident:
            return self._resident[index]
        if self.flat is not None:
            return self.flat[self._span(index)]
        if not self.manager.fits(self._name(index)):
            if index not in self._editing_outsized:
                if index in self._fresh:
                    self.manager.settle(self._name(index))
                    piece = self._fresh.pop(index)
                elif index in self._reading:  # read ahead (the step's split masters)
                    piece = self._landed(index)
                    if overwrite:
                        piece[self.held_numel(index) :].zero_()
                else:
                    piece = self._outsized_buffer(self.layout.buckets[index].piece_numel)
                    if overwrite:
                        piece[self.held_numel(index) :].zero_()
                    else:
                        self.load_into(index, piece)
                self._editing_outsized[index] = piece
            return self._editing_outsized[index]
        if index not in self._editing:
            staged = self._staged.pop(index, None)
            if staged is not None and not overwrite:  # read ahead (the step's split masters): edited as read
                self._editing[index] = staged
                return staged.wait()
            if staged is not None:
                self.manager.release(staged, dirty=False)
            while self._staged and self.manager.all_held():  # a step behind the forward edits while it stages
                self.manager.release(self._staged.popitem()[1], dirty=False)  # the furthest ahead goes first
            handle = self.manager.acquire(self._name(index), read=not overwrite)
            if overwrite:
                handle.tensor[self.held_numel(index) :].zero_()
            self._editing[index] = handle
        return self._editing[index].wait()

    def commit_all(self) -> None:
        """Every piece open for editing goes back (a step abandoned part way, before a load replaces them)."""
        for index in [*self._editing, *self._editing_outsized]:
            self.commit(index)

    def held_numel(self, index: int) -> int:
        """Elements of the rank's piece of unit ``index`` that hold parameters (the rest is padding)."""
        bucket = self.layout.buckets[index]
        start, end = bucket.piece_range(self.rank)
        return max(0, min(end, bucket.numel) - start)

    def edited_in_place(self) -> bool:
        """Whether every piece ``edit`` gives is the shard's own memory, untouched by ``commit``; if not (the NVMe
        home: a ring buffer, or memory written out behind), writes into an edited piece must land before its
        commit."""
        return self.flat is not None

    def commit(self, index: int) -> None:
        self.version += 1
        outsized = self._editing_outsized.get(index)
        if outsized is not None:  # written behind the next tiles; kept for the next gather, within the budget
            self.manager.write_from(self._name(index), outsized, block=False)
            del self._editing_outsized[index]  # only once its write is issued: a failure keeps the new values
            nbytes = outsized.untyped_storage().nbytes()
            if self._fresh_bytes() + nbytes <= self.fresh_budget:
                self._fresh[index] = outsized
            else:
                self._outsized_behind[index] = outsized
        handle = self._editing.pop(index, None)
        if handle is not None:
            self.manager.release(handle, dirty=True)

    def describe(self) -> str:
        """What each tier holds, for the start-up line."""
        if self.flat is not None:
            return f"{self.home.value} {_human(self.flat.numel() * self.flat.element_size())}"
        parts = []
        for where, units in ((f"in host memory (max_in_cpu, cap {self.host_cap:,} elements)", self.kept),
                             ("on NVMe", self.on_nvme)):  # fmt: skip
            numel = sum(self.layout.buckets[index].piece_numel for index in units)
            parts.append(f"{len(units)} units {where}: {numel:,} elements, {_human(numel * self.dtype.itemsize)}")
        ring = self.manager.stats().staging_bytes
        if ring:
            count = self.manager.buffer_count
            parts.append(f"NVMe staging ring {count} x {_human(ring // count)}")
        return "; ".join(parts)

    # ---- whole shard ----
    def read(self, index: int) -> torch.Tensor:
        """A copy of the piece on the host."""
        out = torch.empty(self.layout.buckets[index].piece_numel, dtype=self.dtype)
        self.load_into(index, out)
        return out

    def _check_here(self) -> None:
        if self.parked:
            raise StatesOffloadedError("the parameters' pieces are away (engine.offload_states): call "
                                       "engine.reload_states() first")  # fmt: skip

    def held_tensors(self) -> list[torch.Tensor]:
        """The memory holding the rank's pieces in device or host memory (offload_states parks it)."""
        return ([] if self.flat is None else [self.flat]) + list(self._resident.values())

    def close(self) -> None:
        for index in list(self._copying):
            self._copied(index)
        reading, self._reading = list(self._reading.values()), {}
        try:
            for _, request in reading:
                request.wait()  # its buffer is freed below: the read must not land in freed memory
        finally:
            self._release_all()

    def _release_all(self) -> None:
        self._staged.clear()
        self._fresh.clear()
        self._outsized_behind.clear()
        self._outsized_spares.clear()
        self._editing.clear()
        self._editing_outsized.clear()
        if self.manager is not None:
            self.manager.close()


def parameter_shards(zero: ZeroConfig, aio: AioSettings, comm: Comm, *, run_id: str | None, dtype: torch.dtype,
                     device: torch.device, plan: Plan):  # fmt: skip
    """make_shards for build_units: the rank's parameter shard in the home offload_param gives it, with the plan's
    sizes ([Note: one plan] in memory/plan.py): the host cache (max_in_cpu within the rank's share), the staging
    ring and the outsized pieces kept behind the step."""
    spec = zero.offload_param

    def make(layout: GroupLayout, persistent: set[int]) -> UnitShards:
        home, manager = parameter_tier(zero, aio, rank=comm.rank, run_id=run_id, plan=plan)
        common = {"dtype": dtype, "device": device, "persistent": persistent, "rank": comm.rank, "manager": manager}
        if home is not Tier.NVME:
            return UnitShards(layout, home=home, **common)
        return UnitShards(layout, home=home, max_piece_numel=spec.buffer_size, staging_bytes=plan.staging_bytes,
                          host_numel=plan.host_cache_numel(zero, dtype.itemsize), **common)  # fmt: skip

    return make
