"""AioFile: a file opened once (open_file) and passed to AioHandle instead of a path. The same bytes as a
path request, no open per request, errors that name the path, and a close() that waits for requests in
flight. Real disk under tmp_path."""

import errno
import os
import warnings

import pytest
import torch

from infinity import AioError, AioHandle, ShortTransferError
from infinity.aio import AioFile, DirectIOFallbackWarning, open_file
from infinity.aio import handle as handle_module
from tests.aio.test_fallback import refuse_o_direct
from tests.aio.test_requests import WorkerGate, fd_count
from tests.conftest import MiB, as_bytes, random_tensor

SIZES = [1, 4095, 4097, 12345, 3 * MiB + 7]


def read_file(path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
@pytest.mark.parametrize("offset", [0, 8192, 100], ids=["at-0", "aligned", "unaligned"])
@pytest.mark.parametrize("size", SIZES)
def test_an_open_file_moves_the_same_bytes_as_a_path(disk_dir, size, offset, direct):
    """Written through an AioFile and through a path: the two files are byte for byte the same, and each
    reads back through the other way. Unaligned tails and offsets go through the buffered descriptor."""
    source = random_tensor(size, seed=size + offset)
    by_file, by_path = str(disk_dir / "by_file.bin"), str(disk_dir / "by_path.bin")
    with AioHandle(intra_op_parallelism=2, use_direct_io=direct) as handle, open_file(by_file, write=True) as file:
        assert handle.sync_pwrite(source, file, offset) == size
        handle.sync_pwrite(source, by_path, offset)
        assert read_file(by_file) == read_file(by_path)
        assert len(read_file(by_file)) == offset + size  # exactly the logical bytes: nothing past the tensor
        from_file, from_path = torch.empty_like(source), torch.empty_like(source)
        assert handle.submit_pread(from_file, by_path, offset).wait() == size
        with open_file(by_path, write=False) as reader:
            assert handle.submit_pread(from_path, reader, offset).wait() == size
        assert as_bytes(from_file) == as_bytes(source) == as_bytes(from_path)


def test_unaligned_memory_is_staged_through_an_open_file(disk_dir):
    """A tensor whose memory is not 4 KiB-aligned goes through the staging buffer, with the file's descriptors."""
    size = 2 * MiB + 3
    backing = random_tensor(size + 1, seed=5)
    source = backing[1:]
    path = str(disk_dir / "staged.bin")
    with AioHandle() as handle, open_file(path, write=True) as file:
        handle.sync_pwrite(source, file)
        assert read_file(path) == as_bytes(source)
        target = torch.empty(size + 1, dtype=torch.uint8)[1:]
        handle.sync_pread(target, file)
        assert as_bytes(target) == as_bytes(source)


def test_requests_on_an_open_file_never_open_it_again(disk_dir, monkeypatch):
    """50 writes and 50 reads, queued together: not one call to os.open or to the handle's open_for_io, and
    not one more descriptor while they are in flight or after."""
    path = str(disk_dir / "held.bin")
    sources = [random_tensor(4096 + 1000 * i, seed=i) for i in range(50)]
    offsets = [i * 64 * 1024 for i in range(50)]
    with AioHandle(intra_op_parallelism=2) as handle, open_file(path, write=True) as file:
        opens = []
        real_open, real_open_for_io = os.open, handle_module.open_for_io
        monkeypatch.setattr(os, "open", lambda *a, **k: opens.append(a) or real_open(*a, **k))
        monkeypatch.setattr(handle_module, "open_for_io", lambda *a, **k: opens.append(a) or real_open_for_io(*a, **k))
        before = fd_count()
        gate = WorkerGate(handle)  # every request below is in flight at once
        writes = [handle.submit_pwrite(s, file, o) for s, o in zip(sources, offsets, strict=True)]
        assert fd_count() == before
        gate.open()
        assert all(w.wait() == s.numel() for w, s in zip(writes, sources, strict=True))
        targets = [torch.empty_like(s) for s in sources]
        reads = [handle.submit_pread(t, file, o) for t, o in zip(targets, offsets, strict=True)]
        for r in reads:
            r.wait()
        assert fd_count() == before
        assert opens == []
        monkeypatch.undo()
    assert [as_bytes(t) for t in targets] == [as_bytes(s) for s in sources]


def test_close_while_in_flight_keeps_the_descriptors_until_the_requests_complete(disk_dir):
    """A descriptor closed under a request in flight could be reused by another file and take its bytes."""
    path = str(disk_dir / "closing.bin")
    source = random_tensor(MiB + 5, seed=7)
    with AioHandle() as handle:
        before = fd_count()
        file = open_file(path, write=True)
        assert fd_count() == before + 2  # the O_DIRECT and the buffered descriptor
        gate = WorkerGate(handle)
        request = handle.submit_pwrite(source, file)
        file.close()
        assert file.closed and fd_count() == before + 2  # the request still holds them
        later = handle.submit_pread(torch.empty(10, dtype=torch.uint8), file)
        gate.open()
        assert request.wait() == source.numel()
        assert fd_count() == before  # the last request gave them back: closed now
        with pytest.raises(AioError, match="this AioFile is closed") as info:
            later.wait()
        assert (info.value.path, info.value.errno, info.value.op) == (path, errno.EBADF, "read")
        file.close()  # idempotent
    assert read_file(path) == as_bytes(source)
    assert "closed" in repr(file)


def test_errors_name_the_path_offset_and_errno(disk_dir):
    path = str(disk_dir / "short.bin")
    with open(path, "wb") as f:
        f.write(b"s" * 5000)
    with AioHandle() as handle:
        with open_file(path, write=False) as reader:
            with pytest.raises(ShortTransferError, match="the file has 5000 bytes but this read needs 12192") as info:
                handle.sync_pread(torch.empty(8192, dtype=torch.uint8), reader, 4000)
            assert (info.value.path, info.value.offset) == (path, 4000)
            with pytest.raises(AioError, match="opened for reading only") as info:
                handle.sync_pwrite(torch.empty(10, dtype=torch.uint8), reader, 0)
            assert (info.value.path, info.value.errno) == (path, errno.EBADF)
        with pytest.raises(AioError, match="this AioFile is closed") as info:  # sync_*: raised at call time
            handle.sync_pread(torch.empty(10, dtype=torch.uint8), reader)
        assert info.value.path == path and path in str(info.value)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DirectIOFallbackWarning)
            full = open_file("/dev/full", write=True)  # opens fine; each write fails with ENOSPC
        with full, pytest.raises(AioError) as info:
            handle.submit_pwrite(random_tensor(8192, seed=3), full, 4096).wait()
        assert (info.value.path, info.value.errno) == ("/dev/full", errno.ENOSPC)
        assert info.value.offset >= 4096 and "'/dev/full'" in str(info.value)
    missing = str(disk_dir / "missing.bin")
    with pytest.raises(AioError, match="does not exist") as info:
        open_file(missing, write=False)
    assert (info.value.path, info.value.errno) == (missing, errno.ENOENT)
    assert not os.path.exists(missing)
    for write in (False, True):
        with pytest.raises(AioError, match="is a directory") as info:
            open_file(disk_dir, write=write)
        assert (info.value.path, info.value.errno) == (str(disk_dir), errno.EISDIR)
    with pytest.raises(AioError) as info:
        open_file(path, write=True, exclusive=True)
    assert (info.value.path, info.value.errno) == (path, errno.EEXIST)


def test_failed_opens_leave_no_descriptor(disk_dir):
    before = fd_count()
    for _ in range(5):
        with pytest.raises(AioError):
            open_file(disk_dir, write=False)  # the buffered open succeeds, then EISDIR: it is closed again
        with pytest.raises(AioError):
            open_file(disk_dir / "missing.bin", write=False)
    assert fd_count() == before


def test_a_filesystem_refusing_o_direct_gives_a_buffered_open_file(disk_dir, monkeypatch):
    refuse_o_direct(monkeypatch)
    path = str(disk_dir / "refused.bin")
    with pytest.warns(DirectIOFallbackWarning, match="refused O_DIRECT"):
        file = open_file(path, write=True)
    with file, AioHandle() as handle:
        assert isinstance(file, AioFile) and file.direct_fd is None and "buffered" in repr(file)
        source = random_tensor(MiB + 1, seed=11)
        handle.sync_pwrite(source, file)
        target = torch.empty_like(source)
        handle.sync_pread(target, file)
        assert as_bytes(target) == as_bytes(source)
