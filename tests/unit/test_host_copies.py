"""[Note: host copies] in infinity/memory/copies.py: a host piece copied to the device without blocking is written
by the host only after that copy's event. Without CUDA a copy has finished when it returns, so these tests put a
stand-in event in its place (a CUDA event cannot exist here); tests/gpu checks the real one with a delayed copy."""

from __future__ import annotations

import pytest
import torch

from infinity.memory.copies import CopyStream
from infinity.memory.tiers import Tier, TierManager
from infinity.zero.partition import layout_from_runs
from infinity.zero.shards import UnitShards


class InFlight:
    """Stands in for the CUDA event of a copy still running: the log says when the host waited for it."""

    def __init__(self, log: list, unit: int) -> None:
        self.log, self.unit = log, unit

    def synchronize(self) -> None:
        self.log.append(("waited", self.unit))


class LeftInFlight(CopyStream):
    """A CopyStream whose copies from host memory return before they finish, as pinned copies do with CUDA."""

    def __init__(self, log: list) -> None:
        super().__init__(torch.device("cpu"))
        self.log = log

    def copy(self, out, source, *, then_reuse_source=False):
        out.copy_(source)
        unit = int(source[0])  # the tests fill each unit's piece with its index
        self.log.append(("copied", unit))
        return None if then_reuse_source else InFlight(self.log, unit)


@pytest.mark.parametrize("home", ["host", "nvme-kept"])
def test_the_step_writes_a_host_piece_only_after_its_copy_to_the_device(tmp_path, home):
    """Host pieces (offload_param cpu, or kept in host memory by max_in_cpu in front of NVMe) are the gather's copy
    sources and the step's edit targets: edit() and store() wait for the copy first; a piece not copied since is
    not waited for."""
    layout = layout_from_runs(0, [100, 100, 100], [[0], [1], [2]], world_size=1)
    if home == "host":
        shards = UnitShards(layout, dtype=torch.float32, device=torch.device("cpu"), home=Tier.HOST,
                            persistent=set(), rank=0)  # fmt: skip
    else:
        from infinity.aio.handle import AioHandle
        from infinity.memory.nvme_store import NvmeStore

        handle = AioHandle()
        store = NvmeStore(str(tmp_path), handle=handle, rank=0, run_id="copies")
        manager = TierManager(store=store, handle=handle, buffer_count=1)
        shards = UnitShards(layout, dtype=torch.float32, device=torch.device("cpu"), home=Tier.NVME,
                            persistent=set(), rank=0, manager=manager, host_numel=10**6)  # fmt: skip
        assert sorted(shards.kept) == [0, 1, 2]
    for index in range(3):
        shards.store(index, torch.full((layout.buckets[index].piece_numel,), float(index)))
    log: list = []
    shards.copies = LeftInFlight(log)
    gathered = [torch.empty(layout.buckets[i].piece_numel) for i in range(3)]
    shards.load_into(1, gathered[1])
    shards.load_into(2, gathered[2])
    shards.edit(1).fill_(-1.0)  # the step's new weights
    shards.store(2, torch.full_like(gathered[2], -2.0))  # GatheredParameters(modifier_rank=...) on exit
    shards.edit(0).fill_(-3.0)  # not copied: nothing to wait for
    shards.edit(1)  # waited for once already
    assert log == [("copied", 1), ("copied", 2), ("waited", 1), ("waited", 2)]
    shards.close()
