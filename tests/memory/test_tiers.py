"""The tier manager ([Note: tiers] in infinity/memory/tiers.py) on the real disk: HOST homes, the NVMe staging
ring, its ordering guarantee, its budget, its accounting and its cleanup."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch

from infinity.aio import AioHandle
from infinity.aio.files import AioFile
from infinity.errors import AioError, ConfigError, TierBudgetError
from infinity.memory import NvmeStore
from infinity.memory.tiers import Residency, SegmentHeldError, Tier, TierManager
from tests.aio.test_requests import WorkerGate

MiB = 1 << 20


def tree(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def values(numel: int, seed: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed))


def nvme_manager(path: Path, *, buffer_count: int = 3, intra_op_parallelism: int = 1) -> TierManager:
    handle = AioHandle(intra_op_parallelism=intra_op_parallelism)
    store = NvmeStore(path, handle=handle, run_id="tiers")
    return TierManager(store=store, handle=handle, buffer_count=buffer_count)


def test_host_homes_hand_out_the_same_tensor():
    manager = TierManager()
    manager.add("a", 100, Tier.HOST)
    manager.add("b", 7, Tier.HOST)
    manager.open()
    try:
        manager.initialize("a", lambda t: t.copy_(values(100, 1)))
        first = manager.acquire("a")
        tensor = first.wait()
        assert torch.equal(tensor, values(100, 1)) and first.ready()
        tensor.add_(1)
        manager.release(first, dirty=True)
        again = manager.acquire("a").wait()
        assert again is tensor or again.data_ptr() == tensor.data_ptr()  # the home itself: nothing moved
        assert torch.equal(again, values(100, 1) + 1)
        assert manager.acquire("b").wait().numel() == 7
        stats = manager.stats()
        assert stats.held_bytes == {"host": 107 * 4} and stats.staging_bytes == 0
        assert all(t.bytes == 0 and t.requests == 0 for t in stats.traffic.values())
    finally:
        manager.close()


def test_nvme_round_trip_through_a_ring_smaller_than_the_segments(tmp_path):
    """Ten segments of odd sizes through three buffers: each initialized, read back, changed, read back again."""
    sizes = [1, 1000, 1023, 1024, 1025, 4097, 33, 65536, 77777, 5]
    manager = nvme_manager(tmp_path, buffer_count=3)
    for i, numel in enumerate(sizes):
        manager.add(f"s{i}", numel, Tier.NVME)
    manager.open()
    try:
        stats = manager.stats()
        assert stats.held_bytes == {"nvme": 4 * sum(sizes)}
        assert stats.staging_bytes >= 3 * 4 * max(sizes)
        for i, numel in enumerate(sizes):
            manager.initialize(f"s{i}", lambda t, i=i, numel=numel: t.copy_(values(numel, i)))
        for i, numel in enumerate(sizes):
            handle = manager.acquire(f"s{i}")
            tensor = handle.wait()
            assert torch.equal(tensor, values(numel, i)), i
            tensor.mul_(-2)
            manager.release(handle, dirty=True)
        for i, numel in reversed(list(enumerate(sizes))):
            handle = manager.acquire(f"s{i}")
            assert torch.equal(handle.wait(), values(numel, i) * -2), i
            manager.release(handle, dirty=False)
    finally:
        manager.close()


class _HeldWrite:
    """A write request that starts only when it is waited for (see HeldWrites)."""

    op = "write"

    def __init__(self, start, path: str, offset: int, nbytes: int) -> None:
        self._start = start
        self._request = None
        self.path, self.offset, self.nbytes = path, offset, nbytes

    def done(self) -> bool:
        return self._request is not None and self._request.done()

    def exception(self, timeout: float | None = None):
        if self._request is None:
            self._request = self._start()
        return self._request.exception(timeout)

    def wait(self, timeout: float | None = None) -> int:
        exc = self.exception(timeout)
        if exc is not None:
            raise exc
        return self.nbytes


class HeldWrites(AioHandle):
    """An AioHandle whose writes reach the disk only when someone waits for them; reads run at once. So a read
    queued after a write of the same bytes overtakes it, as it may on a real disk: the kernel completes the
    requests it holds in any order, and so do the handle's worker threads (intra_op_parallelism) when requests are
    cut differently. One plain handle cannot show it: its one queue runs requests in order. Real disk I/O either
    way."""

    def submit_pwrite(self, tensor: torch.Tensor, path, file_offset: int = 0):
        name = path.path if isinstance(path, AioFile) else str(path)
        return _HeldWrite(lambda: AioHandle.submit_pwrite(self, tensor, path, file_offset), name, file_offset,
                          tensor.numel() * tensor.element_size())  # fmt: skip


def test_a_read_never_overtakes_a_pending_write_of_the_same_segment(tmp_path):
    """New values whose write is still pending (released dirty from the ring, or a loose write_from), then the
    segment asked for again (acquire, read_into): the manager must hand out the new values, every time, though the
    disk would serve a read before that write (HeldWrites). Then, with nothing pending, a real read from the disk
    sees the last values: the writes did land."""
    numel = MiB // 4
    handle = HeldWrites()
    manager = TierManager(store=NvmeStore(tmp_path, handle=handle, run_id="tiers"), handle=handle, buffer_count=3)
    manager.add("x", numel, Tier.NVME)
    manager.open()
    try:
        manager.initialize("x", lambda t: t.zero_())
        value = 0.0
        for round_ in range(2):
            for pending in ("ring", "loose"):
                for read in ("acquire", "read_into"):
                    value += 1
                    if pending == "ring":
                        handle_ = manager.acquire("x")
                        handle_.wait().fill_(value)
                        manager.release(handle_, dirty=True)
                    else:
                        manager.write_from("x", torch.full((numel,), value), block=False)
                    assert manager.residency("x") is Residency.IN_FLIGHT
                    if read == "acquire":
                        again = manager.acquire("x")
                        got = again.wait().clone()
                        manager.release(again, dirty=False)
                    else:
                        got = torch.empty(numel)
                        manager.read_into("x", got)
                    where = f"round {round_}, {pending} write, then {read}"
                    assert bool((got == value).all()), f"{where}: read {got.unique()[:4].tolist()}, wrote {value}"
        manager.flush()  # nothing in flight: the next acquire really reads the disk
        fresh = manager.acquire("x")
        assert fresh._request is not None and bool((fresh.wait() == value).all())
        manager.release(fresh, dirty=False)
    finally:
        manager.close()


def test_a_write_waits_for_a_read_of_the_same_segment_on_the_other_queue(tmp_path):
    """Reads and writes have their own queues ([Note: reads beside writes] in infinity/memory/offload.py), so order
    alone no longer keeps a write from landing before a read of the same bytes started earlier: with the read
    queue parked, write_from of the segment waits for start_read's read, which then gets the old values, and the
    disk ends with the new ones."""
    numel = MiB // 4
    writes, reads = AioHandle(), AioHandle()
    store = NvmeStore(tmp_path, handle=writes, read_handle=reads, run_id="tiers")
    manager = TierManager(store=store, handle=writes, read_handle=reads, buffer_count=3)
    manager.add("x", numel, Tier.NVME)
    manager.open()
    try:
        manager.initialize("x", lambda t: t.fill_(1.0))
        manager.flush()
        gate = WorkerGate(reads)
        old = torch.empty(numel)
        request = manager.start_read("x", old)
        writer = threading.Thread(target=manager.write_from, args=("x", torch.full((numel,), 2.0)))
        writer.start()
        writer.join(0.5)
        waited = writer.is_alive()
        gate.open()
        writer.join(30)
        manager.finish_read("x", request)
        assert waited and not writer.is_alive()
        assert bool((old == 1.0).all())
        new = torch.empty(numel)
        manager.read_into("x", new)
        assert bool((new == 2.0).all())
    finally:
        manager.close()


def test_failed_reads_do_not_use_up_the_ring(tmp_path):
    """A read that fails at once (the swap file deleted) leaves its buffer free: more attempts than buffers
    each give the same AioError naming the file, never a TierBudgetError."""
    manager = nvme_manager(tmp_path, buffer_count=2)
    manager.add("x", 1024, Tier.NVME)
    manager.open()
    try:
        manager.initialize("x", lambda t: t.fill_(1.0))
        manager.flush()
        os.unlink(manager.store.swap_path)
        for _ in range(5):
            with pytest.raises(AioError, match="swap"):
                manager.acquire("x")
    finally:
        manager.close()


def test_acquire_without_blocking_returns_none_while_every_buffer_is_busy(tmp_path):
    manager = nvme_manager(tmp_path, buffer_count=3)
    for name in "abcd":
        manager.add(name, 4 * MiB, Tier.NVME)
    manager.open()
    try:
        for name in "abcd":
            manager.initialize(name, lambda t: t.fill_(1.0))
        manager.flush()
        held = [manager.acquire(name) for name in "abc"]
        assert manager.acquire("d", block=False) is None  # all three held
        held[0].wait().fill_(2.0)
        manager.release(held[0], dirty=True)  # 16 MiB write queued: that buffer is busy writing
        assert manager.acquire("d", block=False) is None  # two held, one writing
        handle = manager.acquire("d")  # blocking: waits for the write, then reuses its buffer
        assert bool((handle.wait() == 1.0).all())
        for h in (handle, *held[1:]):
            manager.release(h, dirty=False)
        assert manager.acquire("d", block=False) is not None  # free buffers again
    finally:
        manager.close()


def test_holding_every_buffer_and_acquiring_blocking_is_a_budget_error(tmp_path):
    manager = nvme_manager(tmp_path, buffer_count=3)
    for name in "abcd":
        manager.add(name, 1000, Tier.NVME)
    manager.open()
    try:
        held = [manager.acquire(name, read=False) for name in "abc"]
        message = r"all 3 NVMe staging buffers of offload_optimizer are held.*offload_optimizer.buffer_count"
        with pytest.raises(TierBudgetError, match=message):
            manager.acquire("d")
        for handle in held:
            manager.release(handle, dirty=False)
    finally:
        manager.close()



def test_a_held_nvme_segment_cannot_be_acquired_again(tmp_path):
    """A second handle on a held NVMe segment would be a second copy in another ring buffer, and the last one
    released dirty would overwrite the other's changes: acquiring (blocking or not, reading or not), reading or
    writing it before its handle is released is an error naming it. The held handle is unharmed; after release it
    can be acquired again. HOST homes hand out the home itself, any number of times."""
    manager = nvme_manager(tmp_path, buffer_count=3)
    manager.add("x", 1000, Tier.NVME)
    manager.add("h", 10, Tier.HOST)
    manager.open()
    try:
        manager.initialize("x", lambda t: t.fill_(1.0))
        held = manager.acquire("x")
        held.wait().fill_(2.0)
        message = r"NVMe segment 'x' of offload_optimizer is held.*release its handle before"
        for attempt in (lambda: manager.acquire("x"), lambda: manager.acquire("x", block=False),
                        lambda: manager.acquire("x", read=False), lambda: manager.initialize("x", torch.Tensor.zero_),
                        lambda: manager.read_into("x", torch.empty(1000)),
                        lambda: manager.write_from("x", torch.zeros(1000)),
                        lambda: manager.write_from("x", torch.zeros(1000), block=False)):  # fmt: skip
            with pytest.raises(SegmentHeldError, match=message):
                attempt()
        assert manager.residency("x") is Residency.RESIDENT and bool((held.tensor == 2.0).all())
        manager.release(held, dirty=True)
        again = manager.acquire("x")
        assert bool((again.wait() == 2.0).all())
        manager.release(again, dirty=False)
        assert manager.acquire("h").tensor.data_ptr() == manager.acquire("h").tensor.data_ptr()
    finally:
        manager.close()


def test_stats_count_the_bytes_moved(tmp_path):
    sizes = {"a": 1000, "b": 3000, "c": 17}
    manager = nvme_manager(tmp_path, buffer_count=3)
    for name, numel in sizes.items():
        manager.add(name, numel, Tier.NVME)
    manager.open()
    try:
        for name in sizes:
            manager.initialize(name, lambda t: t.fill_(3.0))
        manager.flush()
        total = 4 * sum(sizes.values())
        window = manager.window()
        assert (window["nvme_write"].bytes, window["nvme_write"].requests) == (total, 3)
        assert (window["nvme_read"].bytes, window["nvme_read"].requests) == (0, 0)
        for name in ("a", "b", "a"):
            handle = manager.acquire(name)
            handle.wait()
            manager.release(handle, dirty=name == "b")
        manager.flush()
        stats = manager.stats()
        reads = 4 * (2 * sizes["a"] + sizes["b"])
        assert (stats.traffic["nvme_read"].bytes, stats.traffic["nvme_read"].requests) == (reads, 3)
        assert (stats.traffic["nvme_write"].bytes, stats.traffic["nvme_write"].requests) == (total + 4 * 3000, 4)
        assert stats.traffic["nvme_read"].blocked_s >= 0 and stats.traffic["nvme_write"].blocked_s >= 0
        window = manager.window()  # since the last window: this round only
        assert (window["nvme_read"].bytes, window["nvme_write"].bytes) == (reads, 4 * 3000)
        assert manager.window()["nvme_read"].bytes == 0
        assert manager.stats().held_bytes == {"nvme": total}
        assert "nvme" in manager.describe() and "staging ring 3 x" in manager.describe()
    finally:
        manager.close()



def test_outsized_traffic_is_counted_apart(tmp_path):
    """Segments larger than a ring buffer move around the ring (read_into / write_from): their traffic is in the
    totals and, apart, under ``outsized``, so a caller can tell that path was taken."""
    manager = nvme_manager(tmp_path, buffer_count=2)
    manager.add("small", 1000, Tier.NVME)
    manager.add("big", 3000, Tier.NVME)
    manager.buffer_bytes = 4000  # "small" fits a ring buffer, "big" does not
    manager.open()
    try:
        assert manager.fits("small") and not manager.fits("big")
        for name, numel in (("small", 1000), ("big", 3000)):
            manager.write_from(name, values(numel, 1))
            out = torch.empty(numel)
            manager.read_into(name, out)
            assert torch.equal(out, values(numel, 1))
        manager.write_from("big", values(3000, 2), block=False)
        manager.flush()
        stats = manager.stats()
        outsized = {d: (t.bytes, t.requests) for d, t in stats.outsized.items()}
        assert outsized == {"nvme_read": (12000, 1), "nvme_write": (24000, 2)}
        assert (stats.traffic["nvme_read"].requests, stats.traffic["nvme_write"].requests) == (2, 3)
        assert stats.as_dict()["outsized"]["nvme_write"]["requests"] == 2
    finally:
        manager.close()


def test_close_removes_the_files_and_is_idempotent(tmp_path):
    manager = nvme_manager(tmp_path)
    manager.add("a", 1000, Tier.NVME)
    manager.add("h", 10, Tier.HOST)
    manager.open()
    manager.initialize("a", lambda t: t.fill_(1.0))
    handle = manager.acquire("a")
    handle.wait().fill_(5.0)
    manager.release(handle, dirty=True)  # a write still in flight: close finishes it, then removes the file
    assert tree(tmp_path) == ["infinity-tiers", "infinity-tiers/rank0", "infinity-tiers/rank0/lock",
                              "infinity-tiers/rank0/swap"]  # fmt: skip
    manager.close()
    assert tree(tmp_path) == []
    manager.close()
    assert tree(tmp_path) == []


def test_setup_mistakes_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="buffer_count"):
        TierManager(buffer_count=0)
    with pytest.raises(ConfigError, match="no swap store"):
        TierManager().add("x", 10, Tier.NVME)
    manager = TierManager()
    manager.open()
    with pytest.raises(ConfigError, match="before the tier manager opens"):
        manager.add("late", 10, Tier.HOST)
    manager.close()


def test_residency_follows_a_segment_through_the_ring(tmp_path):
    """ABSENT on NVMe only, IN_FLIGHT while its read or write runs, RESIDENT while held after the read; HOST homes
    are always RESIDENT."""
    manager = nvme_manager(tmp_path, buffer_count=2)
    manager.add("big", 16 * MiB // 4, Tier.NVME)
    manager.add("host", 10, Tier.HOST)
    manager.open()
    try:
        manager.initialize("big", lambda t: t.fill_(3.0))
        assert manager.residency("host") is Residency.RESIDENT
        manager.flush()
        assert manager.residency("big") is Residency.ABSENT
        handle = manager.acquire("big")
        assert manager.residency("big") in (Residency.IN_FLIGHT, Residency.RESIDENT)
        handle.wait()
        assert manager.residency("big") is Residency.RESIDENT
        manager.release(handle, dirty=True)
        assert manager.residency("big") in (Residency.IN_FLIGHT, Residency.ABSENT)
        manager.flush()
        assert manager.residency("big") is Residency.ABSENT
        assert bool((manager.acquire("big").wait() == 3.0).all())
    finally:
        manager.close()
