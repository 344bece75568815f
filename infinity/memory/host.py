"""Host memory the allocator keeps: glibc's mmap threshold fixed, at 32 MiB or 1 MiB by what the run holds.

glibc serves a block of at least M_MMAP_THRESHOLD bytes with its own mmap and unmaps it when freed; by default
the threshold starts at 128 KiB and rises to the size of any such block freed (up to 32 MiB on 64-bit), after
which blocks that size come from the heap, where freed memory stays in the process for the next allocation.
Fixing the threshold stops the adjustment, so the process behaves the same from its first step.

Where it is fixed matters. A low threshold (1 MiB) hands every freed activation, gradient and buffer back to the
kernel, which faults the next one in page by page and zeroes it: measured on GPT-2 small (bf16, world size 1, stage
3 with parameters and optimizer in host memory), 3.68 s per step at 32 MiB against 5.24 s at 1 MiB (forward 1.46
against 2.08 s, 0.23 against 1.08 s of it system time), peak RSS 4.85 against 4.15 GiB. So training in memory, at
every stage, takes 32 MiB (``threshold_for``), and so does a run with anything on NVMe whose rank has 4 GiB or more
of host memory (GPT-2 small with everything on NVMe: 4.68 s per step at 32 MiB against 7.40 s, peak RSS 3.36 against
2.70 GiB; 1.4 M minor faults and 3.4 s of system time per step at 1 MiB). On a smaller share, and while zero.Init
builds a model ([Note: zero.Init memory] in zero/init.py), 1 MiB stays: there the run's host budget holds only if
freed blocks go back (the host-budget test, parameters and optimizer on NVMe at world size 2 on a 512 MiB node: 183
MiB above the runtime at 32 MiB against 144 allowed, 130-139 at 1 MiB). The engine's own large buffers are reused by
their owners whatever the threshold (gathered units: memory/pool.py). The user's own setting (the environment
variable MALLOC_MMAP_THRESHOLD_) is left alone.

Stage 3 used to keep 1 MiB in memory too, because at 32 MiB its heap grew by 150-350 MiB a step with only ~0.3
GiB in use: torch's multi-grad hooks, left on the step's activations, kept a few hundred small objects alive
among them, so freed activations could not be joined again ([Note: multi-grad hooks] in zero/stage3.py). With
the hooks removed at the end of each pass the heap stays flat, as plain PyTorch's does.

[Note: huge pages]
torch's THP_MEM_ALLOC_ENABLE=1 asks for transparent huge pages (madvise) on its host blocks of 2 MiB and more,
allocated 4 KiB-aligned: fewer faults (each maps 2 MiB), the same zeroing. infinity used to set it on import;
it no longer does, because on the machines measured it cost time in every mode and heap in some: GPT-2 small,
bf16, world size 1, per step, with it against without: stage 3 + cpu offload 5.94 against 5.24 s at 1 MiB and
4.58 against 3.68 s at 32 MiB (where the aligned blocks inside the heap also fragment it: peak RSS 5.48 against
4.85 GiB, and each such block is an madvise call), stage 3 + NVMe 7.3 against 5.9-6.9 s, stage 2 4.42 against
4.25 s (peak RSS 5.69 against 5.11 GiB); a 374M-parameter Llama shape with everything on NVMe 5.42 against 5.21 s.
What it does buy is the fault count of large fresh blocks (that Llama run: 0.32 M minor faults in all against
3.4 M), so a user who counts faults can still set it; torch reads it once, at its first host allocation, so it
must be set before any tensor is made, and the engine says once when it was set but came too late (``huge_pages``
probes it). Where the kernel has transparent huge pages off (``never``) nothing changes.

Blocks allocated before initialize() (the user's model, built before it) may sit in the heap: once initialize()
has moved their values into the shards and freed them, ``trim_heap`` gives their pages back (malloc_trim
releases free pages anywhere in the heap, not only at its top). Measured: a 96 MiB MLP built in the heap stayed
in RSS after its parameters went to NVMe, until trimmed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
import resource

import torch

logger = logging.getLogger("infinity")

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number
REUSE_THRESHOLD_BYTES = 32 << 20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit: freed blocks stay for reuse
RETURN_THRESHOLD_BYTES = 1 << 20  # freed blocks from 1 MiB up go back to the kernel
REUSE_SHARE_BYTES = 4 << 30  # with NVMe, a rank's host share from which freed blocks stay (the share at which the
# plan's staging rings have their full budget: memory/plan.py)
BUILD_THRESHOLD_BYTES = RETURN_THRESHOLD_BYTES  # zero.Init: freed parameters go back ([Note: zero.Init memory])
_fixed: int | None = None
_said_huge_pages = False


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


def threshold_for(*, on_nvme: bool, host_share: int) -> int:
    """The engine's threshold (module docstring): in memory, at any stage, freed blocks stay for reuse; with
    anything on NVMe too where the rank's host share is at least REUSE_SHARE_BYTES, else they go back, so a small
    host budget holds. ``host_share`` is the plan's, the same on every rank of a node."""
    if on_nvme and host_share < REUSE_SHARE_BYTES:
        return RETURN_THRESHOLD_BYTES
    return REUSE_THRESHOLD_BYTES


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


THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"
_PROBE_BYTES = 64 << 20  # above glibc's largest mmap threshold: always a fresh mapping


def kernel_huge_pages() -> bool:
    """Whether the kernel gives transparent huge pages to memory that asks (``always`` or ``madvise``)."""
    try:
        with open(THP_SETTING) as setting:
            return "[never]" not in setting.read()
    except OSError:
        return False


def huge_pages() -> bool:
    """Whether torch's large host tensors get huge pages ([Note: huge pages]): a probe above any mmap threshold,
    a fresh mapping, is touched; on 4 KiB pages that is one fault per page, on huge pages a few per 2 MiB."""
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt  # this thread's: not the I/O threads'
    torch.ones(_PROBE_BYTES, dtype=torch.uint8)
    faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before
    return faults < _PROBE_BYTES // 4096 // 4


def say_huge_pages() -> None:
    """Once per process, where the user asked for huge pages (THP_MEM_ALLOC_ENABLE=1) and the kernel has them but
    torch's tensors are not on them: the setting came after torch's first tensor, and how to get it."""
    global _said_huge_pages
    if _said_huge_pages or os.environ.get("THP_MEM_ALLOC_ENABLE") != "1":  # not asked for: nothing to say
        return
    _said_huge_pages = True  # probed once per process
    if not kernel_huge_pages() or huge_pages():
        return
    logger.info(
        "THP_MEM_ALLOC_ENABLE=1 is set but torch's host tensors are on 4 KiB pages: torch read the setting at its "
        "first tensor, before it was set; set it before any tensor is made (or start with it) for huge pages"
    )


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
