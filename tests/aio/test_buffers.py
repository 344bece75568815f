"""Host buffers: aligned, huge-page backed where the kernel allows, budgeted."""

import pytest
import torch

from infinity import AioHandle, TierBudgetError
from infinity.aio.buffers import (
    HUGE_PAGE_BYTES,
    Backing,
    HostBufferPool,
    allocate_host_buffer,
    anon_huge_page_bytes,
)


def thp_mode():
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "never"


@pytest.mark.parametrize("nbytes", [1, 4096, 3 * HUGE_PAGE_BYTES + 5])
def test_buffers_are_2mib_aligned_and_exact(nbytes):
    buffer = allocate_host_buffer(nbytes)
    assert buffer.address % HUGE_PAGE_BYTES == 0
    assert buffer.data.numel() == nbytes
    buffer.release()
    buffer.release()  # twice is safe


def test_transparent_huge_pages_back_the_buffer():
    if thp_mode() == "never":
        pytest.skip("transparent huge pages are disabled on this machine")
    buffer = allocate_host_buffer(64 << 20, huge_pages="thp")
    assert buffer.backing is Backing.TRANSPARENT_HUGE
    assert anon_huge_page_bytes(buffer) >= (64 << 20) // 2
    buffer.release()


def test_new_cpu_locked_tensor_dtype_and_views():
    with AioHandle() as handle:
        t = handle.new_cpu_locked_tensor(1000, torch.bfloat16)
        assert t.dtype is torch.bfloat16 and t.numel() == 1000 and t.data_ptr() % HUGE_PAGE_BYTES == 0
        like = handle.new_cpu_locked_tensor(10, torch.zeros(1, dtype=torch.float64))
        assert like.dtype is torch.float64
        handle.free_cpu_locked_tensor(t)
        handle.free_cpu_locked_tensor(like)
        with pytest.raises(Exception, match="not made by new_cpu_locked_tensor"):
            handle.free_cpu_locked_tensor(t)


def test_pool_reuses_and_enforces_its_budget():
    pool = HostBufferPool(budget_bytes=8 << 20, huge_pages="none", lock=False)
    a = pool.acquire(3 << 20)
    b = pool.acquire(3 << 20)
    with pytest.raises(TierBudgetError, match="budget of 8388608"):
        pool.acquire(3 << 20)
    pool.release(a)
    c = pool.acquire(2 << 20)
    assert c is a  # reused, best fit
    pool.release(b)
    pool.release(c)
    with pytest.raises(ValueError):
        pool.release(c)
    pool.close()


def test_pin_memory_without_cuda_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("CUDA present: pinning is valid")
    with pytest.raises(Exception, match="pin_memory=True needs CUDA"):
        allocate_host_buffer(4096, pin=True)
