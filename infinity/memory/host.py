"""Host memory the allocator keeps: glibc's mmap threshold fixed at its upper value, 32 MiB.

glibc serves a block of at least M_MMAP_THRESHOLD bytes with its own mmap and unmaps it when freed; by default
the threshold starts at 128 KiB and rises to the size of any such block freed (up to 32 MiB on 64-bit), after
which blocks that size come from the heap, where freed memory stays in the process for the next allocation.
Fixing the threshold stops the adjustment, so the process behaves the same from its first step.

Where it is fixed matters. A low threshold (this module fixed it at 1 MiB before) hands every freed activation,
gradient and gathered buffer back to the kernel, which faults the next one in page by page: measured on GPT-2
(6 blocks, fp32, stage 3, world size 1), 1.43 M minor faults and 5.7 s of system time per 11 s step, against
0.72 M at 32 MiB (the step's optimizer part from 158 k faults to 0, backward from 825 k to 450 k); plain
PyTorch takes 0.39 M. Blocks of 32 MiB and more still go back when freed, so the buffers the engine reuses
(gathered units: memory/pool.py; gradient buckets: zero/reducer.py) are kept by their owners, not by malloc.
While zero.Init builds a model the threshold is 1 MiB instead ([Note: zero.Init memory] in zero/init.py), and
so it stays for training with anything on NVMe, where the host budget is what the user chose (``threshold_for``);
there the engine's own large buffers are kept by their owners. The user's own setting (the environment
variable MALLOC_MMAP_THRESHOLD_) is left alone.

Blocks allocated before that (the user's model, built before initialize()) may sit in the heap: once
initialize() has moved their values into the shards and freed them, ``trim_heap`` gives their pages back
(malloc_trim releases free pages anywhere in the heap, not only at its top). Measured: a 96 MiB MLP built in the
heap stayed in RSS after its parameters went to NVMe, until trimmed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os

logger = logging.getLogger("infinity")

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number
REUSE_THRESHOLD_BYTES = 32 << 20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit: freed blocks stay for reuse
RETURN_THRESHOLD_BYTES = 1 << 20  # freed blocks from 1 MiB up go back to the kernel
BUILD_THRESHOLD_BYTES = RETURN_THRESHOLD_BYTES  # zero.Init: freed parameters go back ([Note: zero.Init memory])
_fixed: int | None = None


@functools.cache
def _libc():
    """The C library, looked up once (find_library may run a subprocess)."""
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name or "libc.so.6")
    except OSError:
        return None


def trim_heap() -> bool:
    """Gives the heap's free pages back to the kernel (glibc's malloc_trim); False where there is no such call."""
    libc = _libc()
    trim = getattr(libc, "malloc_trim", None)
    return bool(trim is not None and trim(0))


def threshold_for(*, on_nvme: bool) -> int:
    """The engine's threshold: with anything on NVMe the host budget is the constraint the user chose, and it
    holds only if freed blocks go back (heap holes left by 64-byte-aligned blocks are not reused for blocks of
    their own size: measured, the host-budget test's peak went from 122 to 229 MiB above the runtime at 32 MiB);
    in memory, the speed of reuse."""
    return RETURN_THRESHOLD_BYTES if on_nvme else REUSE_THRESHOLD_BYTES


def fix_mmap_threshold(nbytes: int) -> bool:
    """Fix glibc's mmap threshold (see the module docstring): ``threshold_for`` the engine's steps,
    BUILD_THRESHOLD_BYTES while zero.Init builds a model. False where it does not apply: another libc, or the
    user chose the threshold."""
    global _fixed
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    if _fixed == nbytes:
        return True
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None or mallopt(M_MMAP_THRESHOLD, nbytes) != 1:
        return False
    _fixed = nbytes
    logger.debug("glibc M_MMAP_THRESHOLD fixed at %d bytes", nbytes)
    return True


def process_status_bytes(field: str) -> int:
    """A size field of /proc/self/status in bytes: VmRSS (resident now), VmHWM (the peak). Read there rather than
    from getrusage's ru_maxrss, which Linux carries across execve: a process started by a large parent (a test
    runner, a notebook) would report the parent's peak. Linux only (as the engine's I/O core): a missing field is a
    KeyError, not a zero a measurement could pass with."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(f"{field} is not in /proc/self/status")
