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
        assert torch.equal(unit.snapshot(), torch.cat(want))
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
        assert torch.equal(unit.snapshot(), torch.cat([piece_values(i) for i in range(len(NUMELS))]))
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
