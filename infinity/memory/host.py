"""Host memory the allocator keeps: glibc's mmap threshold fixed, at 32 MiB or 1 MiB by what the run holds.

glibc serves a block of at least M_MMAP_THRESHOLD bytes with its own mmap and unmaps it when freed; by default
the threshold starts at 128 KiB and rises to the size of any such block freed (up to 32 MiB on 64-bit), after
which blocks that size come from the heap, where freed memory stays in the process for the next allocation.
Fixing the threshold stops the adjustment, so the process behaves the same from its first step.

Where it is fixed matters. A low threshold (1 MiB) hands every freed activation, gradient and buffer back to the
kernel, which faults the next one in page by page: measured on GPT-2 (6 blocks, fp32, stage 3, world size 1),
1.43 M minor faults and 5.7 s of system time per 11 s step, against 0.72 M at 32 MiB (the step's optimizer part
from 158 k faults to 0, backward from 825 k to 450 k); plain PyTorch takes 0.39 M. But at stage 3 the heap
grows instead (``threshold_for``), so only stages 0-2 in memory take 32 MiB; stage 3, anything on NVMe and
zero.Init's build ([Note: zero.Init memory] in zero/init.py) keep 1 MiB, and the engine's own large buffers are
reused by their owners (gathered units: memory/pool.py), not by malloc. The user's own setting (the environment
variable MALLOC_MMAP_THRESHOLD_) is left alone.

[Note: huge pages]
Whatever the threshold, a block glibc maps for itself is faulted in by the kernel 4 KiB at a time, and autograd
makes such blocks every step (each weight's gradient, an embedding's dense gradient): on a 384M-parameter Llama
shape with everything on NVMe, 0.95 M minor faults per step, 23% of the pages the step moves, and on GPT-2 (6
blocks, fp32, stage 3) 1.1 M. torch's own THP_MEM_ALLOC_ENABLE asks for transparent huge pages (madvise) on its
host blocks of 2 MiB and more, so each fault inside them maps 2 MiB: measured, 18-25 k faults per step on the
Llama shape (0.5% of the pages moved) and 0.23 M on GPT-2, at the same peak RSS, system time 7-10 s -> 5-8 s
per step. torch aligns such a block to the 4 KiB page only, not to 2 MiB, so the parts of it outside whole
aligned 2 MiB ranges still fault 4 KiB at a time: measured with a 1 MiB threshold, a 3 MiB block takes 261
faults (one huge page), 4 MiB 515, 12 MiB 518 (five huge pages). Large gradients gain almost everything, a
block of a few MiB (GPT-2's activations: ~0.2 M faults per stage-3 step, against 23 k with the threshold at
32 MiB, which costs ~1.4 GiB of peak RSS for no measurable step time) little. torch reads the variable once,
at its first host allocation, so ``import infinity`` sets it (unless the user has) and it takes effect where
infinity is imported before any tensor is made (the CLI, a script that imports it first); ``huge_pages`` probes
whether it did, and the engine says once how to get it if not. Where the kernel has transparent huge pages off
(``never``) nothing changes.

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
import resource

import torch

logger = logging.getLogger("infinity")

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number
REUSE_THRESHOLD_BYTES = 32 << 20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit: freed blocks stay for reuse
RETURN_THRESHOLD_BYTES = 1 << 20  # freed blocks from 1 MiB up go back to the kernel
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


def threshold_for(*, stage: int, on_nvme: bool) -> int:
    """The engine's threshold. Stages 0-2 in memory: reuse (the step's buffers and activations stay mapped).
    Stage 3, and anything on NVMe: freed blocks go back, because glibc's heap does not reuse the holes that
    64-byte-aligned blocks leave for blocks of their own size, so the heap grows instead: measured, the
    host-budget test's peak went from 122 to 229 MiB above the runtime at 32 MiB, and GPT-2 (6 blocks, fp32,
    world size 1) at stage 3 from 2.91 to 5.90 GiB peak RSS (stage 3 + cpu offload 3.21 -> 7.11 GiB) for a step
    5% faster (10.94 -> 10.35 s) or none (10.97 -> 11.19 s). Stage 3's own large buffers are reused by their
    owners instead (memory/pool.py)."""
    return REUSE_THRESHOLD_BYTES if stage < 3 and not on_nvme else RETURN_THRESHOLD_BYTES


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
    """Once per process: how to get huge pages where the kernel has them and torch's tensors do not."""
    global _said_huge_pages
    if _said_huge_pages or os.environ.get("THP_MEM_ALLOC_ENABLE") != "1":  # the user's choice, said or not
        return
    _said_huge_pages = True  # probed once per process
    if not kernel_huge_pages() or huge_pages():
        return
    logger.info(
        "torch's host tensors are on 4 KiB pages (one page fault per 4 KiB of every gradient autograd makes): "
        "import infinity before any tensor is made, or start with THP_MEM_ALLOC_ENABLE=1, for huge pages"
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
