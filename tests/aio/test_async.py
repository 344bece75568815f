"""Many requests in flight on one handle, then one wait()."""

import os

import torch

from infinity import AioHandle
from tests.conftest import as_bytes, random_tensor

NUM_OPS = 72


def test_many_async_writes_and_reads_then_one_wait(disk_dir):
    sizes = [4096 * (i % 7 + 1) + (i % 3) * 513 for i in range(NUM_OPS)]
    sources = [random_tensor(n, seed=i) for i, n in enumerate(sizes)]
    slot = 64 * 1024  # each op gets its own aligned region of one shared file, or its own file
    with AioHandle(queue_depth=16, intra_op_parallelism=2) as handle:
        for i, source in enumerate(sources):
            if i % 2:
                handle.async_pwrite(source, str(disk_dir / "shared.bin"), file_offset=i * slot)
            else:
                handle.async_pwrite(source, str(disk_dir / f"own{i}.bin"))
        assert handle.pending == NUM_OPS
        assert handle.wait() == NUM_OPS
        assert handle.pending == 0

        targets = [torch.empty_like(s) for s in sources]
        for i, target in enumerate(targets):
            if i % 2:
                handle.async_pread(target, str(disk_dir / "shared.bin"), file_offset=i * slot)
            else:
                handle.async_pread(target, str(disk_dir / f"own{i}.bin"))
        assert handle.wait() == NUM_OPS
    for source, target in zip(sources, targets, strict=True):
        assert as_bytes(target) == as_bytes(source)


def test_async_ops_close_their_files(disk_dir):
    """Open descriptors return to their baseline once the ops are done: nothing leaks per request."""
    before = len(os.listdir("/proc/self/fd"))
    with AioHandle() as handle:
        for i in range(20):
            handle.async_pwrite(random_tensor(4097 * (i + 1), seed=i), str(disk_dir / f"f{i}.bin"))
        handle.wait()
        for i in range(20):
            handle.sync_pread(torch.empty(4097 * (i + 1), dtype=torch.uint8), str(disk_dir / f"f{i}.bin"))
        during = len(os.listdir("/proc/self/fd"))
    assert during <= before + 2  # at most the AIO context's own descriptors, no per-request ones
    assert len(os.listdir("/proc/self/fd")) <= before
