"""Buffered pread/pwrite when O_DIRECT is refused or turned off: the same bytes."""

import errno
import os
import warnings

import pytest
import torch

from infinity import AioHandle
from infinity.aio import DirectIOFallbackWarning
from tests.conftest import MiB, as_bytes, random_tensor

SIZES = [1, 4097, MiB + 1, 9 * MiB + 3]


def round_trip(handle, path, size):
    source = random_tensor(size, seed=size)
    handle.sync_pwrite(source, path)
    assert os.path.getsize(path) == size
    with open(path, "rb") as f:
        assert f.read() == as_bytes(source)
    target = torch.empty_like(source)
    handle.sync_pread(target, path)
    assert as_bytes(target) == as_bytes(source)


@pytest.mark.parametrize("size", SIZES)
def test_tmpfs_path_gives_the_same_bytes(size):
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm on this machine")
    path = f"/dev/shm/infinity-test-{os.getpid()}.bin"
    try:
        with AioHandle(intra_op_parallelism=2) as handle:
            round_trip(handle, path, size)
    finally:
        os.remove(path)


@pytest.mark.parametrize("size", SIZES)
def test_direct_io_turned_off(disk_dir, size):
    with AioHandle(use_direct_io=False, intra_op_parallelism=2) as handle:
        round_trip(handle, str(disk_dir / "buffered.bin"), size)


def refuse_o_direct(monkeypatch) -> None:
    """Makes os.open refuse O_DIRECT (EINVAL), as tmpfs did before Linux 6.6; other opens go through."""
    real_open = os.open

    def refusing_open(path, flags, *args, **kwargs):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", refusing_open)


def test_filesystem_refusing_o_direct_falls_back_with_one_warning(disk_dir, monkeypatch):
    """Simulates a filesystem that refuses O_DIRECT at open; the data still goes to the real disk."""
    refuse_o_direct(monkeypatch)
    path = str(disk_dir / "refused.bin")
    with AioHandle() as handle:
        with pytest.warns(DirectIOFallbackWarning, match="refused O_DIRECT") as record:
            round_trip(handle, path, MiB + 1)
            round_trip(handle, path, 3 * MiB)
        assert len([w for w in record if issubclass(w.category, DirectIOFallbackWarning)]) == 1
        assert path in str(record[0].message)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            handle.sync_pread(torch.empty(5000, dtype=torch.uint8), path)  # same file: no second warning
