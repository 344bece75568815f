"""AioRequest: many requests in flight, each waited for on its own and failing on its own.

Real disk under tmp_path, no mocks. Where a test needs a request that is provably still in flight, it
first parks the handle's worker threads on a gate (WorkerGate), so no assertion depends on timing."""

import errno
import gc
import os
import threading
import time
import warnings
import weakref

import pytest
import torch

from infinity import AioError, AioHandle, AioRequest, ShortTransferError
from infinity.aio import DirectIOFallbackWarning
from tests.conftest import MiB, as_bytes, random_tensor

GATE_LIMIT_S = 30.0


class WorkerGate:
    """Parks every worker thread of ``handle`` until open(): requests submitted meanwhile stay queued.

    A timer opens it after GATE_LIMIT_S, so code that wrongly blocks on a gated request fails the test
    (open() asserts the gate was still shut) instead of hanging it."""

    def __init__(self, handle: AioHandle) -> None:
        self._event = threading.Event()
        self._timer = threading.Timer(GATE_LIMIT_S, self._event.set)
        self._timer.daemon = True
        self._timer.start()
        parked = [threading.Event() for _ in handle._workers]
        self._futures = [w.executor.submit(self._park, p) for w, p in zip(handle._workers, parked, strict=True)]
        for p in parked:
            assert p.wait(GATE_LIMIT_S)  # every worker thread is inside _park: nothing else runs

    def _park(self, parked: threading.Event) -> None:
        parked.set()
        self._event.wait()

    def open(self) -> None:
        still_shut = not self._event.is_set()
        self._event.set()
        self._timer.cancel()
        for future in self._futures:
            future.result()
        assert still_shut, f"the gate opened itself after {GATE_LIMIT_S} s: something blocked on a gated request"


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_many_in_flight_waited_in_reverse_order_byte_for_byte(disk_dir):
    n = 40
    sizes = [4096 * (i % 5 + 1) + (i % 3) * 777 for i in range(n)]
    sources = [random_tensor(size, seed=100 + i) for i, size in enumerate(sizes)]
    slot = 64 * 1024  # odd requests share one file at their own aligned offset; even ones get a file each
    where = [
        (str(disk_dir / "shared.bin"), i * slot) if i % 2 else (str(disk_dir / f"own{i}.bin"), 0) for i in range(n)
    ]
    with AioHandle(queue_depth=8, intra_op_parallelism=2) as handle:
        writes = [handle.submit_pwrite(s, path, file_offset=off) for s, (path, off) in zip(sources, where, strict=True)]
        assert handle.pending == n
        for i in reversed(range(n)):
            request = writes[i]
            assert isinstance(request, AioRequest)
            assert (request.op, request.path, request.offset, request.nbytes) == ("write", *where[i], sizes[i])
            assert request.wait() == sizes[i]
            assert request.done()
        assert handle.pending == 0

        targets = [torch.full_like(s, 0xAA) for s in sources]
        reads = [handle.submit_pread(t, path, file_offset=off) for t, (path, off) in zip(targets, where, strict=True)]
        for i in reversed(range(n)):
            assert reads[i].op == "read"
            assert reads[i].wait() == sizes[i]
            assert as_bytes(targets[i]) == as_bytes(sources[i]), f"request {i} read the wrong bytes"
        assert handle.wait() == 0  # every request was waited for individually: nothing left to count
    with open(disk_dir / "shared.bin", "rb") as f:  # the disk itself, not the engine, agrees
        shared = f.read()
    for i, (path, off) in enumerate(where):
        if i % 2:
            assert shared[off : off + sizes[i]] == as_bytes(sources[i])
        else:
            with open(path, "rb") as f:
                assert f.read() == as_bytes(sources[i])


def test_done_polls_without_blocking_and_means_the_bytes_are_there(disk_dir):
    source = random_tensor(3 * MiB + 123, seed=7)
    path = str(disk_dir / "polled.bin")
    with AioHandle(intra_op_parallelism=1) as handle:
        gate = WorkerGate(handle)
        first = handle.submit_pwrite(source, path)
        later = handle.submit_pread(torch.empty(4096, dtype=torch.uint8), str(disk_dir / "missing.bin"))
        assert not first.done()  # queued behind the gate: in flight, and done() returned without blocking
        assert later.done()  # submitted later, complete first: its file could not be opened
        assert repr(first) == f"AioRequest(write of {path!r} at offset 0, {source.numel()} bytes, in flight)"
        with pytest.raises(TimeoutError, match="still in flight"):
            first.wait(timeout=0.05)
        assert not first.done()
        gate.open()
        deadline = time.monotonic() + GATE_LIMIT_S
        while not first.done():
            assert time.monotonic() < deadline, "done() never became True"
            time.sleep(0.001)
        with open(path, "rb") as f:  # done() is True before any wait(): the write is already complete
            assert f.read() == as_bytes(source)
        assert first.wait() == source.numel()
        assert repr(first).endswith("bytes, done)")
        assert isinstance(later.exception(), AioError)


def _middle_request(kind: str, handle: AioHandle, disk_dir) -> tuple[AioRequest, str, type, int | None]:
    """A request that fails, with the path, exception type and errno its error must have."""
    if kind == "read past the end":
        path = str(disk_dir / "short.bin")
        with open(path, "wb") as f:
            f.write(b"s" * 5000)
        return handle.submit_pread(torch.empty(8192, dtype=torch.uint8), path), path, ShortTransferError, None
    if kind == "missing file":
        path = str(disk_dir / "missing.bin")
        return handle.submit_pread(torch.empty(8192, dtype=torch.uint8), path), path, AioError, errno.ENOENT
    # /dev/full opens fine and fails each write with ENOSPC on the worker thread: an error during the I/O
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DirectIOFallbackWarning)
        return handle.submit_pwrite(random_tensor(8192, seed=3), "/dev/full"), "/dev/full", AioError, errno.ENOSPC


@pytest.mark.parametrize("kind", ["read past the end", "missing file", "disk full"])
def test_each_request_raises_only_its_own_error(disk_dir, kind):
    sources = [random_tensor(10_000 + i, seed=20 + i) for i in range(2)]
    paths = [str(disk_dir / "first.bin"), str(disk_dir / "third.bin")]
    with AioHandle(intra_op_parallelism=2) as handle:
        for source, path in zip(sources, paths, strict=True):
            handle.sync_pwrite(source, path)
        targets = [torch.empty_like(s) for s in sources]
        first = handle.submit_pread(targets[0], paths[0])
        middle, bad_path, error_type, error_errno = _middle_request(kind, handle, disk_dir)
        third = handle.submit_pread(targets[1], paths[1])

        assert first.wait() == sources[0].numel()
        assert third.wait() == sources[1].numel()
        assert as_bytes(targets[0]) == as_bytes(sources[0]) and as_bytes(targets[1]) == as_bytes(sources[1])
        with pytest.raises(AioError) as info:
            middle.wait()
        error = info.value
        assert isinstance(error, error_type) and error.errno == error_errno
        assert error.path == bad_path and bad_path in str(error) and middle.path == bad_path
        with pytest.raises(type(error)) as again:  # waiting twice is fine: the same error
            middle.wait()
        assert again.value is error and middle.exception() is error
        assert first.exception() is None and third.exception() is None
        assert handle.wait() == 0  # all three were waited for individually: nothing counted or raised again


def test_handle_wait_reports_only_requests_not_waited_for_individually(disk_dir):
    tensors = [random_tensor(5000 + i, seed=40 + i) for i in range(3)]
    with AioHandle() as handle:
        handle.async_pwrite(tensors[0], str(disk_dir / "a.bin"))  # DeepSpeed style: only wait() reports it
        ok = handle.submit_pwrite(tensors[1], str(disk_dir / "b.bin"))
        bad = handle.submit_pread(torch.empty(4096, dtype=torch.uint8), str(disk_dir / "missing1.bin"))
        assert handle.pending == 3
        assert ok.wait() == tensors[1].numel()
        with pytest.raises(AioError, match="missing1.bin"):
            bad.wait()
        assert handle.pending == 1
        assert handle.wait() == 1  # the async write only: `ok` is not counted again, `bad` not raised again
        assert handle.pending == 0

        # A failed request nobody waited for is raised by the handle-wide wait, once.
        unwaited = handle.submit_pread(torch.empty(4096, dtype=torch.uint8), str(disk_dir / "missing2.bin"))
        handle.async_pwrite(tensors[2], str(disk_dir / "c.bin"))
        with pytest.raises(AioError, match="missing2.bin") as info:
            handle.wait()
        assert info.value.__notes__ == ["1 of the 2 requests failed; 1 completed"]
        assert unwaited.exception() is info.value  # its own wait still reports it after the handle did
        assert handle.wait() == 0
        assert ok.wait() == tensors[1].numel()  # and a request can be waited for again at any time
    for name, tensor in zip(("a.bin", "b.bin", "c.bin"), tensors, strict=True):
        with open(disk_dir / name, "rb") as f:
            assert f.read() == as_bytes(tensor)


def test_request_holds_its_tensor_until_complete(disk_dir):
    source = random_tensor(1 * MiB + 5, seed=9)
    path = str(disk_dir / "held.bin")
    with AioHandle() as handle:
        handle.sync_pwrite(source, path)
        gate = WorkerGate(handle)
        target = torch.empty_like(source)
        # The same memory through a tensor that is not a view of `target` (a view would keep it alive).
        same_memory = torch.empty(0, dtype=torch.uint8).set_(target.untyped_storage())
        alive = weakref.ref(target)
        request = handle.submit_pread(target, path)
        del target
        gc.collect()
        assert alive() is not None, "the caller dropped its tensor and nothing kept it for the queued read"
        gate.open()
        assert request.wait() == source.numel()
        gc.collect()
        assert alive() is None, "the request kept the tensor after it was complete"
        assert as_bytes(same_memory) == as_bytes(source)


def test_file_descriptors_return_to_baseline(disk_dir):
    before = fd_count()
    with AioHandle(intra_op_parallelism=2) as handle:
        short = str(disk_dir / "short.bin")
        with open(short, "wb") as f:
            f.write(b"x" * 100)
        baseline = fd_count()
        gate = WorkerGate(handle)
        requests = [
            handle.submit_pwrite(random_tensor(8192 + i, seed=i), str(disk_dir / f"f{i}.bin")) for i in range(10)
        ]
        requests.append(handle.submit_pread(torch.empty(4096, dtype=torch.uint8), str(disk_dir / "missing.bin")))
        requests.append(handle.submit_pread(torch.empty(4096, dtype=torch.uint8), short))
        assert fd_count() >= baseline + 10  # each queued request holds its file open
        gate.open()
        errors = [r.exception() for r in requests]
        assert errors[:10] == [None] * 10 and all(isinstance(e, AioError) for e in errors[10:])
        assert fd_count() == baseline  # every request, failed or not, closed its file on completion
    assert fd_count() <= before


def test_closed_handle_refuses_requests_and_earlier_ones_still_report(disk_dir):
    source = random_tensor(2 * MiB + 1, seed=11)
    handle = AioHandle()
    request = handle.submit_pwrite(source, str(disk_dir / "before-close.bin"))
    handle.close()  # finishes the requests in flight
    assert request.done() and request.wait() == source.numel()
    refused = str(disk_dir / "after-close.bin")
    for submit in (handle.submit_pread, handle.submit_pwrite):
        with pytest.raises(AioError, match="this AioHandle is closed") as info:
            submit(torch.zeros(4096, dtype=torch.uint8), refused)
        assert refused in str(info.value)
    assert not os.path.exists(refused)


def test_request_waited_for_during_a_handle_wide_wait_is_reported_once(disk_dir):
    """handle.wait() in one thread has taken both requests; this thread claims the failed one first."""
    source = random_tensor(8192, seed=5)
    with AioHandle() as handle:
        gate = WorkerGate(handle)
        slow = handle.submit_pwrite(source, str(disk_dir / "slow.bin"))  # parked behind the gate
        failed = handle.submit_pread(torch.empty(4096, dtype=torch.uint8), str(disk_dir / "missing.bin"))
        outcome: dict[str, object] = {}

        def wait_all() -> None:
            try:
                outcome["count"] = handle.wait()
            except BaseException as exc:
                outcome["error"] = exc

        waiter = threading.Thread(target=wait_all)
        waiter.start()
        deadline = time.monotonic() + GATE_LIMIT_S
        while handle.pending:  # until the handle-wide wait has taken both and blocks on `slow`
            assert time.monotonic() < deadline
            time.sleep(0.001)
        assert isinstance(failed.exception(), AioError)  # claimed here, while handle.wait() is still blocked
        gate.open()
        waiter.join(GATE_LIMIT_S)
        assert not waiter.is_alive()
        assert outcome == {"count": 1}  # `slow` only: `failed` was reported here, not raised there
        assert slow.wait() == source.numel()
