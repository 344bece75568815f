"""The compiled C core loads, reports its backend, and its libaio-style primitives work."""

import os

import pytest
import torch

from infinity import AioError
from infinity._aio import ffi, lib
from infinity.aio import core
from infinity.aio.buffers import allocate_host_buffer


def test_module_loads_and_reports_backend():
    assert ffi.string(lib.inf_backend()).decode() == "linux-native-aio"
    assert core.BACKEND == "linux-native-aio"


def test_primitives_write_then_read_one_block(disk_dir):
    path = str(disk_dir / "prim.bin")
    buffer = allocate_host_buffer(8192)
    buffer.data.copy_(torch_arange_bytes(8192))
    ctx = ffi.new("aio_context_t *")
    assert lib.inf_io_setup(4, ctx) == 0
    try:
        for is_write in (1, 0):
            flags = (os.O_WRONLY | os.O_CREAT) if is_write else os.O_RDONLY
            fd = os.open(path, flags | os.O_DIRECT, 0o644)
            if not is_write:
                buffer.data.zero_()
            cbs = ffi.new("struct iocb[1]")
            ptrs = ffi.new("struct iocb *[1]", [cbs])
            lib.inf_prep_rw(cbs, fd, is_write, ffi.cast("void *", buffer.address), 8192, 0, 7)
            assert lib.inf_io_submit(ctx[0], 1, ptrs) == 1
            events = ffi.new("struct io_event[1]")
            assert lib.inf_io_getevents(ctx[0], 1, 1, events, -1) == 1
            assert events[0].data == 7
            assert events[0].res == 8192
            os.close(fd)
    finally:
        assert lib.inf_io_destroy(ctx[0]) == 0
    assert bytes(buffer.data.numpy()) == bytes(torch_arange_bytes(8192).numpy())
    with open(path, "rb") as f:
        assert f.read() == bytes(torch_arange_bytes(8192).numpy())


def test_io_setup_reports_errno_not_abort():
    ctx = ffi.new("aio_context_t *")
    assert lib.inf_io_setup(0, ctx) < 0  # EINVAL: zero events


def torch_arange_bytes(n):
    return (torch.arange(n) % 251).to(torch.uint8)


def test_buffer_wrap_streams_a_file_through_a_ring(disk_dir):
    """buffer_wrap: block i uses ring[(i * block) % wrap]; a 4 MiB file written from a 1 MiB ring is the
    ring four times."""
    path = str(disk_dir / "ring.bin")
    ring = allocate_host_buffer(1 << 20)
    ring.data.copy_(torch.randint(0, 256, (1 << 20,), dtype=torch.uint8))
    expected = bytes(ring.data.numpy()) * 4
    ctx = core.AioContext(4)
    settings = core.LoopSettings(block_size=256 << 10, queue_depth=4, single_submit=False, overlap_events=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
    core.rw_direct(
        ctx, fd, is_write=True, address=ring.address, nbytes=4 << 20, offset=0, settings=settings, path=path,
        buffer_wrap=1 << 20,
    )  # fmt: skip
    os.close(fd)
    with open(path, "rb") as f:
        assert f.read() == expected
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        with pytest.raises(AioError, match="bad request arguments"):  # wrap smaller than the queue
            core.rw_direct(
                ctx, fd, is_write=False, address=ring.address, nbytes=4 << 20, offset=0, settings=settings,
                path=path, buffer_wrap=512 << 10,
            )  # fmt: skip
    finally:
        os.close(fd)
        ctx.close()
