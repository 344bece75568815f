"""Asynchronous direct I/O between tensors and files (the NVMe tier's engine)."""

from infinity.aio.buffers import Backing, HostBuffer, HostBufferPool, allocate_host_buffer
from infinity.aio.files import AioFile, DirectIOFallbackWarning, open_file
from infinity.aio.handle import AioHandle, AioSettings
from infinity.aio.request import AioRequest

__all__ = [
    "AioFile",
    "AioHandle",
    "AioRequest",
    "AioSettings",
    "Backing",
    "DirectIOFallbackWarning",
    "HostBuffer",
    "HostBufferPool",
    "allocate_host_buffer",
    "open_file",
]
