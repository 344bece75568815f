"""Shared test helpers: random bytes of a given size and dtype, and a disk directory.

Tests do real I/O on the real disk (pytest's tmp_path lives on the disk, not on tmpfs)."""

from __future__ import annotations

import pytest
import torch

MiB = 1 << 20


def random_tensor(numel: int, dtype: torch.dtype = torch.uint8, seed: int = 0) -> torch.Tensor:
    """Random bit patterns of any dtype (NaN payloads included: compared as bytes)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (numel * itemsize,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype)


def as_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.fixture
def disk_dir(tmp_path):
    return tmp_path


@pytest.fixture
def one_thread():
    """One intra-op thread, as in the distributed tests' processes: on a 2-core machine tiny models run ~50x
    slower with 2 contended threads (measured: 6 ms vs 300 ms per step without offload)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
