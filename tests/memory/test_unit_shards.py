"""offload_param.max_in_cpu ([Note: unit shards] in infinity/zero/shards.py): which pieces stay in host memory in
front of NVMe, and a rank's shard split that way on the real disk (the swap file, the ring, the stats)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from infinity.aio import AioHandle
from infinity.memory import NvmeStore
from infinity.memory.tiers import Tier, TierManager
from infinity.zero.partition import layout_from_runs
from infinity.zero.shards import UnitShards, host_kept
from tests.distributed.training import shard_snapshot

# unit 0 is the persistent one; pieces (world size 1, multiples of ALIGN) of 800, 4000, 240, 1200 and 96 elements
NUMELS = [16, 800, 4000, 240, 1200, 96]


@pytest.mark.parametrize(
    "cap,kept",
    [
        (0, set()),
        (200, {5}),  # only the last, smallest piece fits
        (800, {1}),  # the running total may reach the cap
        (1040, {1, 3}),  # 4000 skipped, 240 still fits after it; 1200 and 96 do not
        (5000, {1, 2, 5}),  # 800 + 4000, then 240 and 1200 do not fit, 96 does
        (10**12, {1, 2, 3, 4, 5}),
    ],
)
def test_host_kept_walks_the_units_in_order(cap, kept):
    pieces = list(enumerate(NUMELS))[1:]
    assert host_kept(pieces, cap) == kept
    assert sum(numel for index, numel in pieces if index in kept) <= cap


def shards(path: Path, host_numel: int) -> UnitShards:
    layout = layout_from_runs(0, NUMELS, [[i] for i in range(len(NUMELS))], world_size=1)
    handle = AioHandle()
    manager = TierManager(store=NvmeStore(path, handle=handle, run_id="shards"), handle=handle, buffer_count=2,
                          owner="offload_param")  # fmt: skip
    return UnitShards(layout, dtype=torch.float32, device=torch.device("cpu"), home=Tier.NVME, persistent={0},
                      rank=0, manager=manager, host_numel=host_numel)  # fmt: skip


def piece_values(index: int) -> torch.Tensor:
    return torch.arange(NUMELS[index], dtype=torch.float32) + 1000 * index


def test_kept_pieces_stay_in_host_memory_and_the_rest_on_nvme(tmp_path):
    unit = shards(tmp_path, host_numel=5000)
    try:
        assert unit.kept == {1, 2, 5} and unit.on_nvme == (3, 4)
        assert [s.name for s in unit.manager.store.layout] == ["unit3", "unit4"]  # the swap file: NVMe pieces only
        assert unit.manager.buffer_bytes == 1200 * 4  # the ring fits the largest NVMe piece, not the kept 4000
        stats = unit.manager.stats()
        assert stats.held_bytes == {"host": (800 + 4000 + 96) * 4, "nvme": (240 + 1200) * 4}
        assert stats.staging_bytes >= 2 * 1200 * 4
        line = unit.describe()
        assert "3 units in host memory (max_in_cpu, cap 5,000 elements): 4,896 elements" in line, line
        assert "2 units on NVMe: 1,440 elements" in line and "NVMe staging ring 2 x" in line, line

        for index in range(len(NUMELS)):
            unit.store(index, piece_values(index))
        assert unit.manager.stats().traffic["nvme_write"].bytes == (240 + 1200) * 4  # kept pieces never written
        assert unit.stage(2) and unit.stage(3) and set(unit._staged) == {3}  # a kept piece takes no buffer
        for index in (2, 3):  # the step's edits: in place for the kept piece, written back for the other
            unit.edit(index).add_(0.5)
            unit.commit(index)
        unit.unstage_all()
        assert unit.on_device(2) is unit.edit(2)  # gathered straight from host memory (the device is the CPU)
        want = [piece_values(i) + (0.5 if i in (2, 3) else 0.0) for i in range(len(NUMELS))]
        assert torch.equal(shard_snapshot(unit), torch.cat(want))
        assert all(torch.equal(unit.read(i), want[i]) for i in range(len(NUMELS)))
        assert unit.manager.stats().traffic["nvme_write"].bytes == (240 + 1200 + 240) * 4
    finally:
        unit.close()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("host_numel", [0, 10**12])
def test_max_in_cpu_zero_puts_every_piece_on_nvme_and_a_large_one_none(tmp_path, host_numel):
    unit = shards(tmp_path, host_numel=host_numel)
    try:
        for index in range(len(NUMELS)):
            unit.store(index, piece_values(index))
        assert torch.equal(shard_snapshot(unit), torch.cat([piece_values(i) for i in range(len(NUMELS))]))
        names = [s.name for s in unit.manager.store.layout]
        if host_numel:
            assert unit.kept == {1, 2, 3, 4, 5} and unit.on_nvme == () and names == []
            assert unit.staging_capacity == 0 and unit.manager.stats().staging_bytes == 0  # no ring, no swap file
            assert "0 units on NVMe: 0 elements" in unit.describe()
        else:
            assert unit.kept == set() and names == [f"unit{i}" for i in range(1, 6)]
            assert unit.manager.buffer_bytes == 4000 * 4
    finally:
        unit.close()
    assert list(tmp_path.iterdir()) == []


def reads(unit: UnitShards) -> int:
    return unit.manager.stats().traffic["nvme_read"].requests


def test_a_piece_the_step_overwrites_is_not_read_and_an_outsized_one_is_kept_for_the_next_gather(tmp_path):
    """The step writes every element of a piece its tiles cover: edit(overwrite=True) reads nothing. An outsized
    piece (here unit 2: 4000 elements, buffer_size 1200) is written behind and the next gather copies it from
    memory; a store() in between (an edit of the weights) replaces it, and the disk has the newest bytes."""
    layout = layout_from_runs(0, NUMELS, [[i] for i in range(len(NUMELS))], world_size=1)
    handle = AioHandle()
    manager = TierManager(store=NvmeStore(tmp_path, handle=handle, run_id="shards"), handle=handle, buffer_count=2)
    unit = UnitShards(layout, dtype=torch.float32, device=torch.device("cpu"), home=Tier.NVME, persistent={0},
                      rank=0, manager=manager, max_piece_numel=1200)  # fmt: skip
    try:
        for index in range(len(NUMELS)):
            unit.store(index, piece_values(index))
        assert not unit.manager.fits("unit2") and unit.manager.fits("unit4")
        before = reads(unit)
        for index in (4, 2):
            unit.edit(index, overwrite=True).copy_(-piece_values(index))
            unit.commit(index)
        assert reads(unit) == before
        out = torch.empty(NUMELS[2])
        unit.load_into(2, out)  # the next forward's gather: from memory
        assert reads(unit) == before and torch.equal(out, -piece_values(2))
        unit.edit(2, overwrite=True).copy_(piece_values(2) * 3)
        unit.commit(2)
        unit.store(2, piece_values(2) * 5)  # GatheredParameters(modifier_rank=...) after the step
        unit.load_into(2, out)
        assert torch.equal(out, piece_values(2) * 5)
        expected = [piece_values(i) * {2: 5, 4: -1}.get(i, 1) for i in range(len(NUMELS))]
        assert torch.equal(shard_snapshot(unit), torch.cat(expected))  # read back from the swap file
    finally:
        unit.close()
    assert list(tmp_path.iterdir()) == []


def test_outsized_pieces_kept_and_written_behind_stay_within_the_staging_budget(tmp_path):
    """Every NVMe piece outsized (buffer_size 64 elements): the pieces kept for the next gather and the loose
    writes in flight never hold more than the staging budget, and a pass's end drops what it did not use."""
    layout = layout_from_runs(0, NUMELS, [[i] for i in range(len(NUMELS))], world_size=1)
    handle = AioHandle()
    manager = TierManager(store=NvmeStore(tmp_path, handle=handle, run_id="shards"), handle=handle, buffer_count=2)
    budget = 1400 * 4  # bytes: room for unit 1 (800 elements) and not for unit 2 (4000) after it
    unit = UnitShards(layout, dtype=torch.float32, device=torch.device("cpu"), home=Tier.NVME, persistent={0},
                      rank=0, manager=manager, max_piece_numel=64, staging_bytes=budget)  # fmt: skip
    try:
        assert not any(unit.manager.fits(f"unit{i}") for i in range(1, 6))
        for index in range(1, len(NUMELS)):
            unit.edit(index, overwrite=True).copy_(piece_values(index))
            unit.commit(index)
            assert unit._fresh_bytes() <= budget and manager._loose_bytes() <= max(budget, NUMELS[index] * 4)
        assert list(unit._fresh) == [1, 3, 5]  # in the step's order, each that still fits: 800 + 240 + 96
        unit.unstage_all()  # the pass ended without gathering them
        assert not unit._fresh
        expected = [torch.zeros(NUMELS[0])] + [piece_values(i) for i in range(1, len(NUMELS))]
        assert torch.equal(shard_snapshot(unit), torch.cat(expected))
        assert not manager._loose_writes
    finally:
        unit.close()
    assert list(tmp_path.iterdir()) == []


def test_loose_writes_in_flight_are_bounded_by_the_ring(tmp_path, monkeypatch):
    """With writes that never look finished, write_from(block=False) itself waits for the oldest ones: the tensors
    the manager keeps alive for writes in flight stay within buffer_count x buffer_bytes (or one write)."""
    from infinity.memory.nvme_store import SegmentRequest

    monkeypatch.setattr(SegmentRequest, "done", lambda self: False)
    layout = layout_from_runs(0, NUMELS, [[i] for i in range(len(NUMELS))], world_size=1)
    handle = AioHandle()
    manager = TierManager(store=NvmeStore(tmp_path, handle=handle, run_id="shards"), handle=handle, buffer_count=2)
    unit = UnitShards(layout, dtype=torch.float32, device=torch.device("cpu"), home=Tier.NVME, persistent={0},
                      rank=0, manager=manager, max_piece_numel=64, staging_bytes=0)  # fmt: skip
    try:
        ring = manager.buffer_count * manager.buffer_bytes
        for index in range(1, len(NUMELS)):
            unit.edit(index, overwrite=True).copy_(piece_values(index))
            unit.commit(index)
            assert manager._loose_bytes() <= max(ring, NUMELS[index] * 4), index
        assert len(manager._loose_writes) == 1  # every piece is larger than the ring: one in flight at a time
        expected = [torch.zeros(NUMELS[0])] + [piece_values(i) for i in range(1, len(NUMELS))]
        assert torch.equal(shard_snapshot(unit), torch.cat(expected))
    finally:
        unit.close()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("overwrite", [True, False])
def test_outsized_pieces_reuse_their_host_buffers_step_after_step(tmp_path, overwrite):
    """Every NVMe piece outsized: each step edits them all (overwriting, or reading first) and commits them, the
    next forward gathers them. From the second step on no buffer is allocated: each edit takes one whose write
    has landed or that the gather has copied, and the spares stay within their budget; the values are the last
    step's, in memory and on disk."""
    layout = layout_from_runs(0, NUMELS, [[i] for i in range(len(NUMELS))], world_size=1)
    handle = AioHandle()
    manager = TierManager(store=NvmeStore(tmp_path, handle=handle, run_id="shards"), handle=handle, buffer_count=2)
    unit = UnitShards(layout, dtype=torch.float32, device=torch.device("cpu"), home=Tier.NVME, persistent={0},
                      rank=0, manager=manager, max_piece_numel=64, staging_bytes=1400 * 4)  # fmt: skip
    try:
        for index in range(1, len(NUMELS)):
            unit.store(index, piece_values(index))
        made = []
        for step in range(1, 5):
            out = {index: torch.empty(NUMELS[index]) for index in range(1, len(NUMELS))}
            for index in out:  # the forward: kept pieces from memory, the rest from the disk
                unit.load_into(index, out[index])
                assert torch.equal(out[index], piece_values(index) * (step if step > 1 else 1)), (step, index)
            unit.unstage_all()
            for index in out:  # the step: every piece's new values
                piece = unit.edit(index, overwrite=overwrite)
                if not overwrite:
                    assert torch.equal(piece, out[index])
                piece.copy_(piece_values(index) * (step + 1))
                unit.commit(index)
            spares = sum(b.numel() * 4 for b in unit._outsized_spares)
            assert spares <= unit.outsized_spare_budget
            made.append(unit.outsized_made)
        assert made[0] > 0 and made[-1] == made[1], made
        manager.flush()
        expected = [torch.zeros(NUMELS[0])] + [piece_values(i) * 5 for i in range(1, len(NUMELS))]
        assert torch.equal(shard_snapshot(unit), torch.cat(expected))
    finally:
        unit.close()
    assert list(tmp_path.iterdir()) == []
