"""A stalled disk must not hang the process: each wait for a direct-I/O completion has a timeout.

Real disk, no mocks: a 1 us timeout is far shorter than any device takes to read 1 MiB with O_DIRECT,
so the first wait gives up while requests are still in flight, exactly as on a dead device."""

import errno
import gc
import os
import weakref

import pytest
import torch

from infinity import AioError, AioHandle, AioTimeoutError, ConfigError
from infinity.aio import core
from infinity.aio.buffers import allocate_host_buffer
from tests.conftest import MiB

FILE_BYTES = 256 * MiB
BLOCK = 1 * MiB
TINY = 1e-6


@pytest.fixture(scope="module")
def big_file(tmp_path_factory):
    """A 256 MiB file written with O_DIRECT (allocated on disk: reads of it need the device)."""
    path = str(tmp_path_factory.mktemp("timeout") / "big.bin")
    with AioHandle(block_size=BLOCK) as handle:
        source = handle.new_cpu_locked_tensor(FILE_BYTES)
        source.copy_(
            torch.randint(0, 256, (FILE_BYTES,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
        )
        assert handle.sync_pwrite(source, path) == FILE_BYTES
        expected = source.clone()
        handle.free_cpu_locked_tensor(source)
    yield path, expected
    os.remove(path)


def _read_times_out(handle, target, path, file_offset, how):
    if how == "async":
        handle.async_pread(target, path, file_offset=file_offset)
        handle.wait()
    else:
        handle.sync_pread(target, path, file_offset=file_offset)


@pytest.mark.parametrize("how", ["locked", "staged", "async"])
def test_read_times_out_names_the_file_then_handle_is_quarantined(big_file, how):
    path, expected = big_file
    half = FILE_BYTES // 2
    handle = AioHandle(block_size=BLOCK, queue_depth=8, timeout_s=TINY)
    # Not 4 KiB-aligned: staged through the worker's buffer; from new_cpu_locked_tensor: used in place.
    unaligned = torch.empty(half + 64, dtype=torch.uint8)[64:]
    target = unaligned if how == "staged" else handle.new_cpu_locked_tensor(half)
    with pytest.raises(AioError) as info:
        _read_times_out(handle, target, path, half, how)
    exc = info.value
    assert isinstance(exc, AioTimeoutError)
    assert exc.errno == errno.ETIMEDOUT
    assert exc.path == path and path in str(exc)
    assert exc.op == "read"
    assert half <= exc.offset < FILE_BYTES and (exc.offset - half) % BLOCK == 0  # a request in flight
    assert "did not complete within 1e-06 s" in str(exc)
    assert "stalled" in str(exc) and "INFINITY_AIO_TIMEOUT_S" in str(exc) and "timeout_s" in str(exc)

    # Quarantined: every later request is refused, naming the timeout, instead of reusing the context.
    with pytest.raises(AioError, match=r"unusable: an earlier read of .* timed out") as refused:
        handle.sync_pread(torch.empty(BLOCK, dtype=torch.uint8), path)
    assert refused.value.errno is None and not isinstance(refused.value, AioTimeoutError)
    with pytest.raises(AioError, match="unusable"):
        handle.async_pwrite(torch.zeros(BLOCK, dtype=torch.uint8), path + ".other")
    assert not os.path.exists(path + ".other")
    handle.close()  # returns: the quarantined context is not destroyed (that would wait on the device)

    # A fresh handle with the normal timeout reads the file correctly.
    with AioHandle(block_size=BLOCK) as fresh:
        assert fresh.timeout_s == core.DEFAULT_TIMEOUT_S
        check = fresh.new_cpu_locked_tensor(half)
        assert fresh.sync_pread(check, path, file_offset=half) == half
        assert torch.equal(check, expected[half:])
        fresh.free_cpu_locked_tensor(check)


def test_core_loop_times_out_and_quarantines_context_and_buffer(big_file):
    """The C loop reports ETIMEDOUT with the oldest request in flight; the context and the buffer's
    owner are held for the life of the process, and the context refuses further loops."""
    path, _ = big_file
    buffer = allocate_host_buffer(64 * MiB)
    owner = weakref.ref(buffer)
    context = core.AioContext(8)
    settings = core.LoopSettings(block_size=BLOCK, queue_depth=8, single_submit=False, overlap_events=False)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        with pytest.raises(AioTimeoutError) as info:
            core.rw_direct(
                context, fd, is_write=False, address=buffer.address, nbytes=64 * MiB, offset=32 * MiB,
                settings=settings, path=path, timeout_s=TINY, keep_alive=buffer,
            )  # fmt: skip
        assert info.value.errno == errno.ETIMEDOUT
        assert 32 * MiB <= info.value.offset < 96 * MiB and info.value.offset % BLOCK == 0
        assert context.quarantined
        del buffer
        gc.collect()
        assert owner() is not None  # the kernel may still write into it: never freed
        with pytest.raises(AioError, match="quarantined"):
            core.rw_direct(
                context, fd, is_write=False, address=owner().address, nbytes=BLOCK, offset=0,
                settings=settings, path=path,
            )  # fmt: skip
        context.close()
        assert not context.closed  # io_destroy was not called
    finally:
        os.close(fd)


@pytest.mark.parametrize("value", [0, -1, 0.0, float("nan"), "10", True])
def test_bad_timeout_raises_config_error_naming_it(value):
    with pytest.raises(ConfigError, match="timeout_s must be a number of seconds > 0") as info:
        AioHandle(timeout_s=value)
    assert repr(value) in str(info.value)


@pytest.mark.parametrize("raw", ["soon", "0", "-5"])
def test_bad_timeout_in_environment_raises_config_error_naming_it(monkeypatch, raw):
    monkeypatch.setenv(core.TIMEOUT_ENV, raw)
    with pytest.raises(ConfigError, match=r"INFINITY_AIO_TIMEOUT_S must be a number of seconds > 0") as info:
        AioHandle()
    assert repr(raw) in str(info.value)


def test_timeout_from_argument_environment_or_default(monkeypatch):
    monkeypatch.delenv(core.TIMEOUT_ENV, raising=False)
    with AioHandle() as handle:
        assert handle.timeout_s == 300.0
    monkeypatch.setenv(core.TIMEOUT_ENV, "2.5")
    with AioHandle() as handle:
        assert handle.timeout_s == 2.5
    with AioHandle(timeout_s=7) as handle:  # the argument wins
        assert handle.timeout_s == 7.0
    with AioHandle(timeout_s=float("inf")) as handle:  # no limit
        assert handle.timeout_s == float("inf")
