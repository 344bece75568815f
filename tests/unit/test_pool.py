"""StoragePool: a storage filled and emptied again keeps its identity (views autograd saved see the new values)
and reuses the memory it gave back, within the budget."""

from __future__ import annotations

import torch

from infinity.memory.pool import StoragePool


def released(numel: int) -> torch.Tensor:
    full = torch.empty(numel, dtype=torch.float32)
    full.untyped_storage().resize_(0)
    return full


def test_a_filled_storage_reuses_the_memory_it_gave_back_and_its_views_see_new_values():
    pool = StoragePool(budget_bytes=1 << 20)
    full = released(1000)
    pool.fill(full.untyped_storage(), 4000)
    full.fill_(1.0)
    view = full[10:20]  # what autograd would save in forward
    first = full.data_ptr()
    pool.empty(full.untyped_storage())
    assert full.untyped_storage().nbytes() == 0 and pool.kept_bytes == 4000 and pool.in_use_bytes == 0
    pool.fill(full.untyped_storage(), 4000)
    assert full.data_ptr() == first and pool.stats.reused == 1 and pool.stats.made == 1
    full.fill_(2.0)
    assert torch.equal(view, torch.full((10,), 2.0))


def test_memory_beyond_the_budget_goes_back():
    pool = StoragePool(budget_bytes=6000)
    a, b = released(1000), released(1000)
    pool.fill(a.untyped_storage(), 4000)
    pool.fill(b.untyped_storage(), 4000)  # beyond the budget: still filled (the caller bounds what is live)
    assert pool.stats.peak_bytes == 8000
    pool.empty(a.untyped_storage())
    pool.empty(b.untyped_storage())  # 4000 kept + 4000 > 6000: not kept
    assert pool.kept_bytes == 4000 and pool.stats.dropped == 1


def test_a_new_size_makes_room_by_dropping_kept_buffers_of_other_sizes():
    pool = StoragePool(budget_bytes=6000)
    a, c = released(1000), released(500)
    pool.fill(a.untyped_storage(), 4000)
    pool.empty(a.untyped_storage())
    pool.fill(c.untyped_storage(), 2000)  # 4000 kept + 2000 fits
    assert pool.kept_bytes == 4000 and pool.stats.made == 2
    pool.empty(c.untyped_storage())
    d = released(750)
    pool.fill(d.untyped_storage(), 3000)  # 6000 kept + 3000 does not: the larger kept one goes
    assert pool.kept_bytes == 2000 and pool.stats.dropped == 1
    pool.clear()
    assert pool.kept_bytes == 0
