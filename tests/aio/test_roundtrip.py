"""Round trips of random bytes through AioHandle, checked against what is on disk."""

import itertools
import os
import subprocess
import sys

import pytest
import torch

from infinity import AioHandle
from tests.conftest import MiB, as_bytes, random_tensor

BLOCK = 1 * MiB
SIZES = [1, 511, 4095, 4096, 4097, BLOCK - 1, BLOCK + 1, 64 * MiB + 3]
OFFSETS = [0, 3 * 4096]
FLAGS = list(itertools.product([False, True], [False, True], [1, 32], [1, 4]))  # single, overlap, qd, intra

_handles: dict = {}


def handle_for(single_submit, overlap_events, queue_depth, intra_op_parallelism):
    key = (single_submit, overlap_events, queue_depth, intra_op_parallelism)
    if key not in _handles:
        _handles[key] = AioHandle(
            block_size=BLOCK,
            queue_depth=queue_depth,
            single_submit=single_submit,
            overlap_events=overlap_events,
            intra_op_parallelism=intra_op_parallelism,
        )
    return _handles[key]


@pytest.fixture(scope="module", autouse=True)
def _close_handles():
    yield
    for handle in _handles.values():
        handle.close()
    _handles.clear()


def check_round_trip(handle, source, path, offset, locked_target=False):
    nbytes = source.numel() * source.element_size()
    assert handle.sync_pwrite(source, path, file_offset=offset) == nbytes
    assert os.path.getsize(path) == offset + nbytes
    with open(path, "rb") as f:
        f.seek(offset)
        assert f.read() == as_bytes(source), "bytes on disk differ from the tensor"
    target = handle.new_cpu_locked_tensor(source.numel(), source.dtype) if locked_target else torch.empty_like(source)
    assert handle.sync_pread(target, path, file_offset=offset) == nbytes
    assert as_bytes(target) == as_bytes(source)
    if locked_target:
        handle.free_cpu_locked_tensor(target)


@pytest.mark.parametrize("flags", FLAGS, ids=lambda f: "ss{}-ov{}-qd{}-p{}".format(*map(int, f)))
@pytest.mark.parametrize("offset", OFFSETS)
@pytest.mark.parametrize("size", SIZES)
def test_round_trip_locked_memory(disk_dir, flags, offset, size):
    """The fast path: 2 MiB-aligned buffers from new_cpu_locked_tensor, used in place."""
    handle = handle_for(*flags)
    source = handle.new_cpu_locked_tensor(size, torch.uint8)
    source.copy_(random_tensor(size, seed=size + offset))
    check_round_trip(handle, source, str(disk_dir / "f.bin"), offset, locked_target=True)
    handle.free_cpu_locked_tensor(source)


@pytest.mark.parametrize("intra", [1, 4])
@pytest.mark.parametrize("offset", OFFSETS)
@pytest.mark.parametrize("size", SIZES)
def test_round_trip_ordinary_tensors(disk_dir, intra, offset, size):
    """Tensors from torch.empty are not 4 KiB-aligned: they are staged through aligned buffers."""
    handle = handle_for(False, True, 8, intra)
    check_round_trip(handle, random_tensor(size, seed=size), str(disk_dir / "f.bin"), offset)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("numel", [1, 4097, BLOCK + 1, 3 * MiB + 5])
def test_round_trip_dtypes(disk_dir, dtype, numel):
    handle = handle_for(False, True, 8, 4)
    source = random_tensor(numel, dtype, seed=numel)
    if numel % 2:
        source = source.reshape(-1, 1)  # any contiguous shape
    check_round_trip(handle, source, str(disk_dir / "f.bin"), 4096)


def test_unaligned_tail_does_not_touch_bytes_past_the_end(disk_dir):
    """Writing 4097 bytes into a longer file changes exactly those bytes; the size is kept."""
    path = str(disk_dir / "long.bin")
    with open(path, "wb") as f:
        f.write(b"\xab" * (3 * MiB))
    handle = handle_for(False, True, 8, 1)
    source = random_tensor(4097, seed=5)
    handle.sync_pwrite(source, path, file_offset=8192)
    with open(path, "rb") as f:
        data = f.read()
    assert len(data) == 3 * MiB
    assert data[:8192] == b"\xab" * 8192
    assert data[8192 : 8192 + 4097] == as_bytes(source)
    assert data[8192 + 4097 :] == b"\xab" * (3 * MiB - 8192 - 4097)


def test_write_at_unaligned_offset_and_read_back(disk_dir):
    handle = handle_for(False, True, 8, 1)
    check_round_trip(handle, random_tensor(BLOCK + 7, seed=9), str(disk_dir / "f.bin"), 1000)


def test_zero_sized_tensor_creates_file(disk_dir):
    handle = handle_for(False, True, 8, 1)
    path = str(disk_dir / "empty.bin")
    assert handle.sync_pwrite(torch.empty(0), path) == 0
    assert os.path.getsize(path) == 0
    assert handle.sync_pread(torch.empty(0), path) == 0


_NO_TEAM_SCRIPT = """
import os, sys, threading, torch
from infinity import AioHandle
torch.set_num_threads(2)

def started_by_torch():  # OS threads that Python did not start: OpenMP's
    return {int(t) for t in os.listdir("/proc/self/task")} - {t.native_id for t in threading.enumerate()}

source = torch.arange(16 << 20, dtype=torch.float32)
torch.mul(source, 1.0)  # the main thread's own team exists now
if torch.cuda.is_available():  # CUDA's own threads start before the count (staging buffers are pinned there)
    torch.cuda.init()
    torch.empty(1, pin_memory=True)
before = started_by_torch()
with AioHandle(intra_op_parallelism=2) as handle:
    unaligned = source[1:]  # 4 bytes past an aligned start: staged both ways, where the disk takes O_DIRECT
    for _ in range(2):
        handle.sync_pwrite(unaligned, os.path.join(sys.argv[1], "staged"))
        back = torch.empty_like(unaligned)
        handle.sync_pread(back, os.path.join(sys.argv[1], "staged"))
    assert torch.equal(back, unaligned)
    staged = any(worker._staging is not None for worker in handle._workers)
    print(int(staged), len(started_by_torch() - before))
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_staged_transfers_start_no_openmp_team_on_the_workers(disk_dir):
    """A torch copy on a worker thread would start an OpenMP team there, and libgomp then throttles the spinning
    of the main thread's team too ([Note: no OpenMP off the main thread]): the workers copy with memmove. In a
    fresh process, where the main thread's team is the only one."""
    done = subprocess.run([sys.executable, "-c", _NO_TEAM_SCRIPT, str(disk_dir)], capture_output=True, text=True,
                          timeout=120, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    staged, started = done.stdout.split()
    if staged == "0":
        pytest.skip("this disk refuses O_DIRECT: nothing was staged")
    assert started == "0", f"{started} thread(s) started by staged transfers"
