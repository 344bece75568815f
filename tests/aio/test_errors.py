"""Every failure is a specific exception naming the path or argument; the handle keeps working."""

import errno
import fcntl
import os
import struct

import pytest
import torch

from infinity import AioError, AioHandle, ConfigError, InvalidTensorError, ShortTransferError
from infinity.aio import core
from infinity.aio.buffers import allocate_host_buffer
from tests.conftest import as_bytes, random_tensor


@pytest.fixture
def handle():
    with AioHandle() as h:
        yield h


def assert_still_works(handle, disk_dir):
    source = random_tensor(10_000, seed=1)
    path = str(disk_dir / "after-error.bin")
    handle.sync_pwrite(source, path)
    target = torch.empty_like(source)
    handle.sync_pread(target, path)
    assert as_bytes(target) == as_bytes(source)


@pytest.mark.parametrize("op", ["sync_pread", "sync_pwrite", "async_pread", "async_pwrite"])
def test_missing_directory(handle, disk_dir, op):
    path = str(disk_dir / "no-such-dir" / "x.bin")
    with pytest.raises(AioError) as info:
        getattr(handle, op)(torch.zeros(8192, dtype=torch.uint8), path)
    assert info.value.errno == errno.ENOENT
    assert info.value.path == path
    assert path in str(info.value) and "does not exist" in str(info.value)
    assert handle.pending == 0
    assert_still_works(handle, disk_dir)


@pytest.mark.parametrize("file_bytes,offset", [(1000, 0), (8192, 4096), (0, 0)])
def test_read_past_end_of_file(handle, disk_dir, file_bytes, offset):
    path = str(disk_dir / "short.bin")
    with open(path, "wb") as f:
        f.write(b"x" * file_bytes)
    with pytest.raises(ShortTransferError) as info:
        handle.sync_pread(torch.empty(8192, dtype=torch.uint8), path, file_offset=offset)
    message = str(info.value)
    assert path in message and f"has {file_bytes} bytes" in message and str(offset + 8192) in message
    assert_still_works(handle, disk_dir)


@pytest.mark.parametrize("direct", [True, False])
def test_core_reports_short_read_with_offset(disk_dir, direct):
    """The C loop itself detects a short transfer (e.g. a file truncated under a running read)."""
    path = str(disk_dir / "core-short.bin")
    with open(path, "wb") as f:
        f.write(b"y" * (3 * 4096))
    buffer = allocate_host_buffer(8 * 4096)
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    try:
        with pytest.raises(ShortTransferError) as info:
            if direct:
                ctx = core.AioContext(4)
                settings = core.LoopSettings(block_size=4096, queue_depth=4, single_submit=False, overlap_events=True)
                core.rw_direct(
                    ctx,
                    fd,
                    is_write=False,
                    address=buffer.address,
                    nbytes=8 * 4096,
                    offset=0,
                    settings=settings,
                    path=path,
                )
                ctx.close()
            else:
                core.rw_buffered(fd, is_write=False, address=buffer.address, nbytes=8 * 4096, offset=0, path=path)
    finally:
        os.close(fd)
    assert info.value.offset == 3 * 4096
    assert "short read" in str(info.value) and path in str(info.value)


@pytest.mark.parametrize("op", ["sync_pread", "sync_pwrite"])
def test_path_is_a_directory(handle, disk_dir, op):
    target = disk_dir / "a-dir"
    target.mkdir()
    with pytest.raises(AioError) as info:
        getattr(handle, op)(torch.zeros(8192, dtype=torch.uint8), str(target))
    assert info.value.errno == errno.EISDIR
    assert "is a directory" in str(info.value) and str(target) in str(info.value)
    assert_still_works(handle, disk_dir)


FS_IOC_GETFLAGS, FS_IOC_SETFLAGS, FS_IMMUTABLE_FL = 0x80086601, 0x40086602, 0x10


def _set_immutable(path, on):
    fd = os.open(path, os.O_RDONLY)
    try:
        buf = bytearray(8)
        fcntl.ioctl(fd, FS_IOC_GETFLAGS, buf)
        flags = struct.unpack("l", buf)[0]
        flags = flags | FS_IMMUTABLE_FL if on else flags & ~FS_IMMUTABLE_FL
        fcntl.ioctl(fd, FS_IOC_SETFLAGS, struct.pack("l", flags))
    finally:
        os.close(fd)


def test_read_only_file_for_writing(handle, disk_dir):
    path = str(disk_dir / "ro.bin")
    with open(path, "wb") as f:
        f.write(b"z" * 4096)
    os.chmod(path, 0o444)
    immutable = False
    if os.geteuid() == 0:  # root ignores mode bits: make the file immutable instead
        try:
            _set_immutable(path, True)
            immutable = True
        except OSError as e:
            pytest.skip(f"running as root and cannot set the immutable flag here: {e}")
    try:
        with pytest.raises(AioError) as info:
            handle.sync_pwrite(torch.zeros(8192, dtype=torch.uint8), path)
        assert info.value.errno in (errno.EACCES, errno.EPERM)
        assert path in str(info.value)
    finally:
        if immutable:
            _set_immutable(path, False)
    with open(path, "rb") as f:
        assert f.read() == b"z" * 4096  # nothing was lost
    assert_still_works(handle, disk_dir)


def test_non_contiguous_tensor(handle, disk_dir):
    tensor = torch.zeros(64, 64)[:, ::2]
    with pytest.raises(InvalidTensorError, match=r"not contiguous.*contiguous\(\)"):
        handle.sync_pwrite(tensor, str(disk_dir / "nc.bin"))
    assert not (disk_dir / "nc.bin").exists()


def test_not_a_tensor(handle, disk_dir):
    with pytest.raises(InvalidTensorError, match="torch.Tensor"):
        handle.sync_pwrite(b"bytes", str(disk_dir / "x.bin"))


@pytest.mark.parametrize(
    "kwargs,name",
    [
        ({"queue_depth": 0}, "queue_depth"),
        ({"queue_depth": -4}, "queue_depth"),
        ({"block_size": -1}, "block_size"),
        ({"block_size": 3}, "block_size"),
        ({"block_size": 4096 * 3 + 1}, "block_size"),
        ({"intra_op_parallelism": 0}, "intra_op_parallelism"),
        ({"single_submit": "yes"}, "single_submit"),
    ],
)
def test_bad_settings_name_the_argument(kwargs, name):
    with pytest.raises(ConfigError, match=rf"aio\.{name} must"):
        AioHandle(**kwargs)


def test_negative_offset(handle, disk_dir):
    with pytest.raises(ConfigError, match="file_offset"):
        handle.sync_pwrite(torch.zeros(10), str(disk_dir / "x.bin"), file_offset=-4096)


def test_failed_async_op_is_reported_by_wait_and_never_counted(handle, disk_dir):
    """/dev/full accepts the open and fails every write with ENOSPC: a real I/O-time failure."""
    good = [random_tensor(5000, seed=i) for i in range(3)]
    for i, tensor in enumerate(good):
        handle.async_pwrite(tensor, str(disk_dir / f"good{i}.bin"))
    with pytest.warns(Warning):
        handle.async_pwrite(random_tensor(8192, seed=9), "/dev/full")
    with pytest.raises(AioError) as info:
        handle.wait()
    assert info.value.errno == errno.ENOSPC
    assert info.value.path == "/dev/full"
    assert info.value.__notes__ == ["1 of the 4 requests failed; 3 completed"]  # no default: the note must exist
    assert handle.wait() == 0  # the failed op is gone, not pending, not done
    for i, tensor in enumerate(good):
        with open(disk_dir / f"good{i}.bin", "rb") as f:
            assert f.read() == as_bytes(tensor)
    assert_still_works(handle, disk_dir)


def test_closed_handle_refuses(disk_dir):
    handle = AioHandle()
    handle.close()
    with pytest.raises(AioError, match="closed"):
        handle.sync_pwrite(torch.zeros(8), str(disk_dir / "x.bin"))
