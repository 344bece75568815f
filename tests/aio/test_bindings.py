"""The compiled C core loads, reports its backend, and its libaio-style primitives work."""

import os

import torch

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
