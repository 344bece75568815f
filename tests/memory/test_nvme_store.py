"""NvmeStore on the real disk (pytest's tmp_path): layout, direct I/O, run folders and their locks, the
checks at open and before reads, cleanup at close, at exit and on signals. Other processes are real
subprocesses (a crashed run is one killed with SIGKILL)."""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import pytest
import torch

from infinity.aio import AioHandle, DirectIOFallbackWarning
from infinity.aio import handle as handle_module
from infinity.errors import AioError, ConfigError, InvalidTensorError, ShortTransferError, TierBudgetError
from infinity.memory import NvmeStore, SwapLayout
from tests.aio.test_requests import WorkerGate, fd_count
from tests.conftest import MiB, as_bytes, random_tensor

REPO = Path(__file__).resolve().parents[2]
ODD_SIZES = [("one", 1), ("page_less_one", 4095), ("page", 4096), ("page_plus_one", 4097), ("odd", 12345),
             ("big", 3 * MiB + 7)]  # fmt: skip


@pytest.fixture
def handle():
    with AioHandle(intra_op_parallelism=2) as h:
        yield h


def tree(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


# ---- subprocesses ----
CHILD_OPENS_STORE = """
import os, signal, sys, time
import torch
from infinity.aio import AioHandle
from infinity.memory import NvmeStore
store = NvmeStore(sys.argv[1], handle=AioHandle(), run_id=sys.argv[2], segments=[("s", 10000)])
store.open()
store.sync_write("s", torch.ones(10000, dtype=torch.uint8))
"""


def spawn(nvme_path: Path, run_id: str, tail: str) -> subprocess.Popen:
    code = CHILD_OPENS_STORE + textwrap.dedent(tail)
    return subprocess.Popen(
        [sys.executable, "-c", code, str(nvme_path), run_id],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_default_signals,
    )


def _default_signals() -> None:
    """The child starts with SIGINT and SIGTERM at their defaults, as a Python started from a terminal does: a
    shell's background job (e.g. a CI script run with `&`) passes SIGINT on ignored, and then Python installs no
    KeyboardInterrupt handler and the store (rightly) leaves an ignored signal alone."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_DFL)


def wait_ready(proc: subprocess.Popen) -> None:
    line = proc.stdout.readline()
    if line.strip() != "ready":
        proc.kill()
        raise AssertionError(f"child did not get ready: {line!r} {proc.communicate()[1]}")


# ---- round trip and layout ----
@pytest.mark.parametrize("checksum", [False, True])
def test_round_trip_of_odd_sized_segments_is_byte_exact(tmp_path, handle, checksum):
    store = NvmeStore(tmp_path, handle=handle, run_id="rt", checksum=checksum)
    sources = {}
    for name, nbytes in ODD_SIZES:
        dtype = torch.bfloat16 if nbytes % 2 == 0 else torch.uint8  # any dtype: only bytes count
        sources[name] = random_tensor(nbytes // torch.empty((), dtype=dtype).element_size(), dtype, seed=nbytes)
        store.add(name, nbytes)
    with store:
        writes = [store.write(name, tensor) for name, tensor in sources.items()]  # all in flight at once
        assert [w.wait() for w in writes] == [nbytes for _, nbytes in ODD_SIZES]
        targets = {name: torch.zeros_like(t) for name, t in sources.items()}
        reads = [store.read(name, targets[name]) for name in reversed(list(sources))]
        for request in reads:
            request.wait()
            assert request.done()
        for name in sources:
            assert as_bytes(targets[name]) == as_bytes(sources[name]), name
        total = sum(nbytes for _, nbytes in ODD_SIZES)
        stats = store.stats
        assert (stats.write.bytes, stats.write.requests) == (total, len(ODD_SIZES))
        assert (stats.read.bytes, stats.read.requests) == (total, len(ODD_SIZES))
        assert stats.read.wait_s > 0 and stats.write.wait_s > 0
        one = torch.empty(1, dtype=torch.uint8)
        assert store.sync_read("one", one) == 1 and as_bytes(one) == as_bytes(sources["one"])
        assert store.stats.read.requests == len(ODD_SIZES) + 1


def test_segment_requests_open_nothing(tmp_path, handle, monkeypatch):
    """The swap file is opened once, at open(): 50 writes and 50 reads (queued together) call neither
    os.open nor the handle's open_for_io, and the process holds exactly as many descriptors as before,
    with the requests in flight and after."""
    sizes = [(f"s{i}", 4096 * (i % 4) + 1000 * i + 1) for i in range(50)]
    sources = {name: random_tensor(nbytes, seed=i) for i, (name, nbytes) in enumerate(sizes)}
    with NvmeStore(tmp_path, handle=handle, segments=sizes) as store:
        opens = []
        real_open, real_open_for_io = os.open, handle_module.open_for_io
        monkeypatch.setattr(os, "open", lambda *a, **k: opens.append(a) or real_open(*a, **k))
        monkeypatch.setattr(handle_module, "open_for_io", lambda *a, **k: opens.append(a) or real_open_for_io(*a, **k))
        before = fd_count()
        gate = WorkerGate(handle)
        writes = [store.write(name, tensor) for name, tensor in sources.items()]
        assert fd_count() == before
        gate.open()
        for request in writes:
            request.wait()
        targets = {name: torch.empty_like(t) for name, t in sources.items()}
        reads = [store.read(name, targets[name]) for name in sources]
        for request in reads:
            request.wait()
        assert fd_count() == before
        assert opens == []
        monkeypatch.undo()
        assert all(as_bytes(targets[name]) == as_bytes(sources[name]) for name in sources)
        assert store.stats.write.requests == store.stats.read.requests == 50


def test_close_with_requests_in_flight_keeps_their_descriptors_until_they_complete(tmp_path, handle):
    """close() unlinks the file at once; a write still queued finishes against the unlinked file (its
    descriptors close when it completes), never against a descriptor number reused by another file."""
    before = fd_count()
    store = NvmeStore(tmp_path, handle=handle, segments=[("s", 3 * MiB + 5)]).open()
    gate = WorkerGate(handle)
    request = store.write("s", random_tensor(3 * MiB + 5))
    store.close()
    assert tree(tmp_path) == []
    assert fd_count() == before + 2  # the swap file's two descriptors, held by the request
    gate.open()
    assert request.wait() == 3 * MiB + 5
    assert fd_count() == before


def test_reads_run_beside_the_writes_queued_before_them(tmp_path, handle):
    """With a read_handle ([Note: reads beside writes] in infinity/memory/offload.py) a read does not wait for the
    writes submitted before it: with the write handle's workers parked, a read of another segment lands, with
    the bytes written earlier, while the queued write is still not done. The writes land once the gate opens."""
    old, new = random_tensor(MiB, seed=1), random_tensor(MiB, seed=2)
    with AioHandle() as reads:
        store = NvmeStore(tmp_path, handle=handle, read_handle=reads, segments=[("a", MiB), ("b", MiB)]).open()
        try:
            store.sync_write("b", old)
            gate = WorkerGate(handle)
            write = store.write("a", new)
            got = torch.empty(MiB, dtype=torch.uint8)
            store.read("b", got).wait(timeout=10)
            queued = not write.done()
            gate.open()
            write.wait()
            assert queued and as_bytes(got) == as_bytes(old)
            store.sync_read("a", got)
            assert as_bytes(got) == as_bytes(new)
        finally:
            store.close()


def test_a_write_after_the_file_is_deleted_does_not_hide_it(tmp_path, handle):
    """The open descriptors keep writing to the unlinked file; the next read still fails, naming it."""
    with NvmeStore(tmp_path, handle=handle, segments=[("a", 10000)]) as store:
        store.sync_write("a", random_tensor(10000))
        os.unlink(store.swap_path)
        store.sync_write("a", random_tensor(10000, seed=1))
        assert not os.path.exists(store.swap_path)  # not recreated behind the store's back
        with pytest.raises(AioError, match="was deleted") as info:
            store.read("a", torch.empty(10000, dtype=torch.uint8))
        assert (info.value.path, info.value.errno) == (store.swap_path, errno.ENOENT)
    assert tree(tmp_path) == []


def test_segments_are_4k_aligned_and_padded_and_the_file_is_preallocated(tmp_path, handle):
    layout = SwapLayout.from_sizes(ODD_SIZES)
    end = 0
    for segment in layout:
        assert segment.offset % 4096 == 0 and segment.padded_nbytes % 4096 == 0
        assert segment.offset >= end and segment.padded_nbytes >= segment.nbytes > segment.padded_nbytes - 4096
        end = segment.end
    assert layout.total_bytes == end == sum(-(-n // 4096) * 4096 for _, n in ODD_SIZES)
    with NvmeStore(tmp_path, handle=handle, segments=ODD_SIZES) as store:
        assert [s.offset for s in store.layout] == [s.offset for s in layout]
        info = os.stat(store.swap_path)
        assert info.st_size == layout.total_bytes
        assert info.st_blocks * 512 >= layout.total_bytes  # blocks reserved (fallocate), not a sparse file
        assert sorted(os.listdir(store.folder)) == ["lock", "swap"]
        assert store.folder == str(tmp_path / f"infinity-{store.run_id}" / "rank0")
        assert f"pid {os.getpid()}" in Path(store.lock_path).read_text()


def resident_pages(path: str, offset: int, length: int) -> int:
    """How many pages of path[offset:offset+length] are in the page cache (mincore on a mapping)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    fd = os.open(path, os.O_RDONLY)
    try:
        address = libc.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, offset)
        if address in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap")
        pages = (ctypes.c_ubyte * (length // mmap.PAGESIZE))()
        try:
            if libc.mincore(address, length, pages) != 0:
                raise OSError(ctypes.get_errno(), "mincore")
        finally:
            libc.munmap(address, length)
        return sum(p & 1 for p in pages)
    finally:
        os.close(fd)


@pytest.mark.parametrize("direct", [True, False])
def test_direct_io_is_used_for_every_aligned_page(tmp_path, direct):
    """Direct I/O bypasses the page cache: after a write and a read, none of the segment's 4 KiB pages are
    cached. The buffered run (use_direct_io=False) shows the measure sees the difference."""
    size = 2 * MiB + 100  # the last 100 bytes go through pwrite by design
    source = random_tensor(size, seed=3)
    with (
        warnings.catch_warnings(record=True) as caught,
        AioHandle(use_direct_io=direct) as handle,
        NvmeStore(tmp_path, handle=handle, segments=[("pad", 100), ("seg", size)]) as store,
    ):
        warnings.simplefilter("always")
        segment = store.layout["seg"]
        store.sync_write("seg", source)
        after_write = resident_pages(store.swap_path, segment.offset, 2 * MiB)
        target = torch.empty_like(source)
        store.sync_read("seg", target)
        after_read = resident_pages(store.swap_path, segment.offset, 2 * MiB)
        assert as_bytes(target) == as_bytes(source)
    assert not [w for w in caught if issubclass(w.category, DirectIOFallbackWarning)]
    if direct:
        assert (after_write, after_read) == (0, 0)
    else:
        assert after_read == 2 * MiB // mmap.PAGESIZE


# ---- run folders and locks ----
def test_crashed_run_folder_is_removed_and_live_one_kept(tmp_path, handle, caplog):
    live = spawn(tmp_path, "live", 'print("ready", flush=True); time.sleep(120)')
    try:
        wait_ready(live)  # before the crash: the live run's own open would remove the crashed folder
        # a run's folders, one per kind as an engine makes them; then no cleanup at all
        crashed = spawn(tmp_path, "crashed", """
            others = [NvmeStore(sys.argv[1], handle=AioHandle(), run_id=f"{sys.argv[2]}-{kind}",
                                segments=[("s", 4096)]).open() for kind in ("params", "gradients")]
            os.kill(os.getpid(), signal.SIGKILL)
        """)  # fmt: skip
        assert crashed.wait(timeout=60) == -signal.SIGKILL
        crashed_folders = [tmp_path / f"infinity-crashed{kind}" / "rank0" for kind in ("", "-params", "-gradients")]
        for folder in crashed_folders:
            assert sorted(os.listdir(folder)) == ["lock", "swap"]
        live_files = tree(tmp_path / "infinity-live")
        with caplog.at_level(logging.WARNING, logger="infinity"), NvmeStore(tmp_path, handle=handle, run_id="mine"):
            assert not any(folder.parent.exists() for folder in crashed_folders)
            assert tree(tmp_path / "infinity-live") == live_files == ["rank0", "rank0/lock", "rank0/swap"]
            with pytest.raises(ConfigError, match=rf"in use by a live process \(pid {live.pid} on host"):
                NvmeStore(tmp_path, handle=handle, run_id="live").open()  # same run id and rank: refused
            assert tree(tmp_path / "infinity-live") == live_files  # and untouched
        lines = [r.getMessage() for r in caplog.records if r.name == "infinity"]
        assert len(lines) == 1, lines  # one line for the run's three folders
        assert all(str(folder) in lines[0] for folder in crashed_folders) and f"pid {crashed.pid}" in lines[0]
    finally:
        live.kill()
        live.wait()


def test_lockless_folder_is_removed_only_once_old(tmp_path, handle, caplog):
    young = tmp_path / "infinity-young" / "rank0"
    old = tmp_path / "infinity-old" / "rank3"
    for folder in (young, old):
        folder.mkdir(parents=True)
        (folder / "swap").write_bytes(b"x" * 10)
    os.utime(old, (0, 0))
    with caplog.at_level(logging.WARNING, logger="infinity"), NvmeStore(tmp_path, handle=handle, run_id="now"):
        assert young.exists() and not (tmp_path / "infinity-old").exists()
    assert [str(old) in r.getMessage() for r in caplog.records] == [True]


def test_two_runs_coexist_and_ranks_share_the_run_folder(tmp_path, handle):
    a = NvmeStore(tmp_path, handle=handle, run_id="run-a", segments=[("s", 5000)]).open()
    b = NvmeStore(tmp_path, handle=handle, run_id="run-b", segments=[("s", 5000)]).open()
    b1 = NvmeStore(tmp_path, handle=handle, run_id="run-b", rank=1, segments=[("s", 5000)]).open()
    data = {store: random_tensor(5000, seed=i) for i, store in enumerate((a, b, b1))}
    for store, tensor in data.items():
        store.sync_write("s", tensor)
    for store, tensor in data.items():
        target = torch.empty_like(tensor)
        store.sync_read("s", target)
        assert as_bytes(target) == as_bytes(tensor)
    assert len({a.swap_path, b.swap_path, b1.swap_path}) == 3
    b.close()
    assert tree(tmp_path / "infinity-run-b") == ["rank1", "rank1/lock", "rank1/swap"]  # rank 1 still there
    b1.close()
    a.close()
    assert tree(tmp_path) == []


def test_default_run_ids_differ_per_process_and_bad_ones_are_refused(tmp_path, handle):
    assert str(os.getpid()) in NvmeStore(tmp_path, handle=handle).run_id
    for bad in ("", "../up", "a/b", ".hidden", "x" * 101):
        with pytest.raises(ConfigError, match="run_id"):
            NvmeStore(tmp_path, handle=handle, run_id=bad)


# ---- checks at open ----
def test_free_space_is_checked_before_anything_is_written(tmp_path, handle):
    vfs = os.statvfs(tmp_path)
    free = vfs.f_bavail * vfs.f_frsize
    need = free + (1 << 30)
    store = NvmeStore(tmp_path, handle=handle, run_id="big", segments=[("huge", need - 4096), ("small", 10)])
    with pytest.raises(TierBudgetError) as info:
        store.open()
    message = str(info.value)
    assert f"needs {need} bytes" in message and repr(str(tmp_path)) in message
    reported_free = int(re.search(r"has (\d+) bytes", message).group(1))
    assert abs(reported_free - free) < (1 << 30)  # others may write meanwhile
    assert tree(tmp_path) == []


def test_missing_nvme_path(tmp_path, handle):
    missing = tmp_path / "nope"
    with pytest.raises(ConfigError, match=rf"nvme_path '{re.escape(str(missing))}' does not exist: create it"):
        NvmeStore(missing, handle=handle).open()
    assert not missing.exists()


def test_nvme_path_that_is_a_file(tmp_path, handle):
    file = tmp_path / "file"
    file.write_bytes(b"")
    with pytest.raises(ConfigError, match=rf"nvme_path '{re.escape(str(file))}' is not a directory"):
        NvmeStore(file, handle=handle).open()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through permission bits")
def test_read_only_nvme_path(tmp_path, handle):
    folder = tmp_path / "ro"
    folder.mkdir(mode=0o500)
    try:
        with pytest.raises(ConfigError, match=rf"'{re.escape(str(folder))}' is not writable .* chmod"):
            NvmeStore(folder, handle=handle).open()
    finally:
        folder.chmod(0o700)


# ---- growing an open store (zero.Init) ----
def test_append_grows_an_open_store_and_keeps_what_is_there(tmp_path, handle):
    store = NvmeStore(tmp_path, handle=handle, segments=[("first", 5000)]).open()
    try:
        first = random_tensor(5000)
        store.sync_write("first", first)
        added = {name: random_tensor(nbytes, seed=i + 1) for i, (name, nbytes) in enumerate(ODD_SIZES)}
        for name, values in added.items():
            segment = store.append(name, values.numel())
            assert segment.offset % 4096 == 0 and segment.offset >= store.layout["first"].end
            store.sync_write(name, values)
        assert os.path.getsize(store.swap_path) == store.layout.total_bytes
        back = torch.empty(5000, dtype=torch.uint8)
        store.sync_read("first", back)
        assert torch.equal(back, first)
        for name, values in added.items():
            back = torch.empty_like(values)
            store.sync_read(name, back)
            assert torch.equal(back, values), name
        with pytest.raises(ConfigError, match="'first' is already in this store"):
            store.append("first", 10)
        os.truncate(store.swap_path, store.layout["big"].offset)  # the appended tail is checked like the rest
        with pytest.raises(ShortTransferError, match="was truncated"):
            store.read("first", back[:5000].clone())
    finally:
        store.close()
    assert tree(tmp_path) == []


def test_append_needs_an_open_store_and_room_on_the_disk(tmp_path, handle):
    store = NvmeStore(tmp_path, handle=handle, segments=[("a", 10)])
    with pytest.raises(ConfigError, match=r"append\(\) needs an open store"):
        store.append("b", 10)
    store.open()
    try:
        vfs = os.statvfs(tmp_path)
        with pytest.raises(TierBudgetError, match=r"needs .* more for segment 'huge'") as info:
            store.append("huge", vfs.f_bavail * vfs.f_frsize + (1 << 30))
        assert repr(str(tmp_path)) in str(info.value)
        assert "huge" not in store.layout  # nothing changed
        assert os.path.getsize(store.swap_path) == store.layout.total_bytes
    finally:
        store.close()



def test_appending_many_segments_is_linear(tmp_path, handle):
    """zero.Init appends one segment per parameter: 20k small parameters must not cost 20k copies of a growing
    layout (O(P^2): ~3 s of CPU here, where the appends' own statvfs and fallocate take ~0.3 s). A complexity
    guard, not a speed claim: the bound is generous, on CPU time (not disturbed by other processes' load)."""
    count = 20_000
    store = NvmeStore(tmp_path, handle=handle).open()
    try:
        started = time.process_time()
        for index in range(count):
            store.append(f"piece{index}", 4 * (index % 7 + 1))
        seconds = time.process_time() - started
        print(f"{count} appends: {seconds:.2f} s of CPU")
        assert seconds < 2.0, f"{count} appends took {seconds:.1f} s of CPU: the layout grows quadratically"
        layout = store.layout
        assert len(layout) == count and layout.total_bytes == count * 4096 == os.path.getsize(store.swap_path)
        assert layout[f"piece{count - 1}"].offset == (count - 1) * 4096
        values = random_tensor(4 * ((count - 1) % 7 + 1), seed=3)
        store.sync_write(f"piece{count - 1}", values)
        back = torch.empty_like(values)
        store.sync_read(f"piece{count - 1}", back)
        assert torch.equal(back, values)
    finally:
        store.close()


# ---- checks at read and write ----
@pytest.mark.parametrize("damage", ["truncated", "deleted", "replaced"])
def test_damaged_swap_file_fails_the_read_naming_it(tmp_path, handle, damage):
    store = NvmeStore(tmp_path, handle=handle, segments=[("a", 10000), ("b", 10000)]).open()
    try:
        store.sync_write("a", random_tensor(10000))
        store.sync_write("b", random_tensor(10000, seed=1))
        if damage == "truncated":
            os.truncate(store.swap_path, store.layout["b"].offset + 5000)
            expected, pattern = ShortTransferError, "was truncated"
        elif damage == "deleted":
            os.unlink(store.swap_path)
            expected, pattern = AioError, "was deleted"
        else:
            os.unlink(store.swap_path)
            Path(store.swap_path).write_bytes(b"\0" * store.layout.total_bytes)
            expected, pattern = AioError, "was replaced"
        for name in ("a", "b"):  # a truncation past "a" still fails "a": the whole file is checked
            with pytest.raises(expected, match=pattern) as info:
                store.read(name, torch.empty(10000, dtype=torch.uint8))
            assert info.value.path == store.swap_path and store.swap_path in str(info.value)
            assert name in str(info.value)
        if damage == "deleted":
            assert info.value.errno == errno.ENOENT
    finally:
        store.close()
    assert tree(tmp_path) == []


def test_wrong_tensor_size_or_unknown_segment_is_named(tmp_path, handle):
    with NvmeStore(tmp_path, handle=handle, segments=[("weights", 4000)]) as store:
        with pytest.raises(InvalidTensorError, match=r"segment 'weights' holds 4000 bytes but the tensor has 4004"):
            store.write("weights", torch.empty(1001, dtype=torch.float32))
        with pytest.raises(InvalidTensorError, match="'weights' holds 4000 bytes but the tensor has 2000"):
            store.read("weights", torch.empty(1000, dtype=torch.float16))
        with pytest.raises(ConfigError, match=r"no swap segment 'bias' .* \(it has 'weights'\)"):
            store.read("bias", torch.empty(4000, dtype=torch.uint8))
        with pytest.raises(ConfigError, match="before the store is opened"):
            store.add("late", 10)
        assert store.stats.write.requests == 0


def test_checksum_catches_bytes_changed_behind_the_store(tmp_path, handle):
    source = random_tensor(50000, seed=9)
    for checksum in (True, False):
        store = NvmeStore(tmp_path, handle=handle, run_id=f"crc-{checksum}", segments=[("s", 50000)], checksum=checksum)
        with store:
            store.sync_write("s", source)
            fd = os.open(store.swap_path, os.O_WRONLY)
            os.pwrite(fd, bytes([as_bytes(source)[12345] ^ 0xFF]), 12345)
            os.close(fd)
            target = torch.empty_like(source)
            if checksum:
                request = store.read("s", target)
                with pytest.raises(AioError, match="checksum mismatch in swap segment 's'") as info:
                    request.wait()
                assert info.value.path == store.swap_path
                assert request.exception() is info.value  # the same answer when asked again
                assert store.stats.read.requests == 0
                store.sync_write("s", source)  # a fresh write makes it readable again
                store.sync_read("s", target)
                assert as_bytes(target) == as_bytes(source)
            else:  # off by default: the changed byte comes back silently
                store.sync_read("s", target)
                assert as_bytes(target) != as_bytes(source)


# ---- cleanup ----
def test_close_removes_everything_and_is_idempotent(tmp_path, handle):
    store = NvmeStore(tmp_path, handle=handle, segments=[("s", 4096)]).open()
    store.sync_write("s", random_tensor(4096))
    folder = Path(store.folder)
    assert folder.is_dir()
    store.close()
    assert tree(tmp_path) == []
    store.close()
    assert tree(tmp_path) == []
    with pytest.raises(ConfigError, match="is closed"):
        store.read("s", torch.empty(4096, dtype=torch.uint8))
    with pytest.raises(ConfigError, match="is closed"):
        store.open()
    # the lock is released: another store can take the same folder at once
    with NvmeStore(tmp_path, handle=handle, run_id=store.run_id):
        assert folder.is_dir()
    assert tree(tmp_path) == []


def test_exit_without_close_leaves_no_files(tmp_path):
    child = spawn(tmp_path, "exits", 'print("ready", flush=True)')
    wait_ready(child)
    assert child.wait(timeout=60) == 0, child.stderr.read()
    assert tree(tmp_path) == []


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_leaves_no_files_and_keeps_the_default_behaviour(tmp_path, signum):
    """SIGTERM: only the store's handler can clean up (the default action skips atexit). SIGINT: the
    handler cleans up before KeyboardInterrupt; the exit hook would too, so this checks the outcome."""
    child = spawn(tmp_path, "signalled", 'print("ready", flush=True); time.sleep(120)')
    wait_ready(child)
    assert tree(tmp_path) == ["infinity-signalled", "infinity-signalled/rank0"] + [
        f"infinity-signalled/rank0/{n}" for n in ("lock", "swap")
    ]
    child.send_signal(signum)
    rc = child.wait(timeout=60)
    if signum == signal.SIGTERM:
        assert rc == -signal.SIGTERM  # killed by the signal, as without the store
    else:
        # Python's own SIGINT behaviour: KeyboardInterrupt, and an exit that re-raises SIGINT
        assert rc == -signal.SIGINT and "KeyboardInterrupt" in child.stderr.read()
    assert tree(tmp_path) == []


def test_signal_chains_to_the_previous_handler(tmp_path):
    tail = """
    print("ready", flush=True)
    time.sleep(120)
    """
    code_head = "import signal, os\nsignal.signal(signal.SIGTERM, lambda s, f: os._exit(7))\n"
    child = subprocess.Popen(
        [sys.executable, "-c", code_head + CHILD_OPENS_STORE + textwrap.dedent(tail), str(tmp_path), "chained"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_ready(child)
    child.send_signal(signal.SIGTERM)
    assert child.wait(timeout=60) == 7  # the program's own handler ran (after the store's cleanup)
    assert tree(tmp_path) == []
