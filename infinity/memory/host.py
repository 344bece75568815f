"""Host memory the allocator keeps: freed blocks stay in the process for the next step, or go back to the kernel.

glibc serves a block of at least M_MMAP_THRESHOLD bytes with its own mmap and unmaps it when freed; by default
the threshold starts at 128 KiB and rises to the size of any such block freed (up to 32 MiB on 64-bit, its
largest), after which blocks that size come from the heap, where freed memory stays for the next allocation.
A block above 32 MiB is always a fresh mapping, which the kernel faults in page by page and zeroes, and every
step of a training run frees and allocates such blocks (GPT-2 small: the logits, their fp32 copy for the loss,
log-softmax and their gradients, 100-200 MiB each): ~420 k minor faults and ~1 s of system time per step, in
plain PyTorch, FSDP2 and DeepSpeed alike.

The engine therefore chooses one of two heap policies for its steps (``policy_for``):
- KEEP: no block is mapped on its own (M_MMAP_MAX 0) and the heap's top is never trimmed (M_TRIM_THRESHOLD -1):
  every freed block stays in the heap and the next step's blocks reuse it, as a caching allocator does (in the
  main thread's heap; another thread's blocks of 64 MiB and more are still mapped on their own, glibc's limit for
  its other arenas). Measured
  on GPT-2 small (bf16, world size 1, seq 256, micro batch 4, medians over steps 3-7, each in its own process),
  KEEP against glibc's threshold fixed at 32 MiB: stage 2 1.67 against 2.09 s per step, stage 3 1.86 against
  2.53-2.83 s, stage 3 + cpu offload 2.12 against 2.91 s, stage 3 + nvme 2.68 against 3.45 s; 0-50 k minor faults
  per step against ~430 k, ~0.1 against ~1 s of system time. The price is the heap's fragmentation, held for the
  run: peak RSS 5.25 against 4.73 GiB at stage 2, 5.2-5.6 against 4.5 GiB at stage 3, 5.47 against 4.53 with cpu
  offload, 3.79 against 3.27 with nvme. Training in memory, at every stage, takes KEEP, and so does a run with
  anything on NVMe whose rank has REUSE_SHARE_BYTES (4 GiB) of host memory or more.
- RETURN: glibc's threshold fixed at 1 MiB (and the top trimmed above 2 MiB, glibc's own ratio): every freed
  block from 1 MiB up goes back to the kernel. A run with anything on NVMe on a smaller share takes it, and so
  does zero.Init while it builds a model ([Note: zero.Init memory] in zero/init.py): there the run's host budget
  holds only if freed blocks go back (the host-budget test, parameters and optimizer on NVMe at world size 2 on
  a 512 MiB node: 183 MiB above the runtime at a 32 MiB threshold against 144 allowed, 130-139 at 1 MiB).

KEEP's heap stays near its settled size: glibc (before 2.38) extends the heap for an aligned block while a hole
its size lies free, and torch asks for every block aligned. Under KEEP torch's blocks of 1 MiB and more are
therefore asked of plain malloc where glibc is that old ([Note: aligned blocks and glibc] in
torch_cpu_allocator.py: GPT-2 small at stage 3, peak RSS 4.09 against 5.63 GiB at the same step time); where
that allocator cannot be built, and for the blocks below 1 MiB, ``HeapWatch`` gives the free pages back when the
resident size passes the settled one by an eighth (256 MiB at least), and the next step faults its working set
in once.

KEEP's cache has a budget: the host's memory. After each optimizer step the engine checks the memory available on
the host (``give_back_if_short``); where it has fallen below an eighth of what the plan found at initialize (other
jobs, the other ranks, a larger batch), the policy becomes RETURN for the rest of the run, the heap's free pages
are given back, and the engine says so once: the run goes on, slower, instead of the node running out.

[Note: setup memory]
Stage 3's initialize() fills each unit from the whole values of its parameters (a gathered zero.Init piece, the
unit's flat copy, its piece in the compute dtype): large buffers made once. Under KEEP the heap holds every one of
them when freed, and the next unit's, a little larger or smaller, rarely fits the holes: on a 5.19B-parameter
Llama shape (everything on NVMe, int8 states) initialize() peaked at 11.75 GiB against 8.43 GiB in the steps.
So after each unit, once SETUP_FREE_BYTES (1 GiB) lie free in the heap, its free pages are given back
(``trim_after_setup_unit``): the peak falls to the steps' (RSS trace of the same run, trimming after every unit
of 64 MiB or more: 7.21 GiB). Where less lies free the holes are left: the steps reuse them. On GPT-2 small with
everything on NVMe (0.2 GiB free after setup), a trim after its 154 MB embedding unit made two runs of four fault
50-75 k times a step with 4.3 GiB peak RSS, against 0-1.3 k and 3.9-4.1 GiB without
(benchmarks/train_vs_peers.py); running all of setup under RETURN did the same.

The engine's own large buffers are reused by their owners whatever the policy (gathered units: memory/pool.py).
A user who sets glibc's own variables (MALLOC_MMAP_THRESHOLD_, MALLOC_MMAP_MAX_, MALLOC_TRIM_THRESHOLD_) keeps
them: the engine then changes nothing.

Stage 3 used to keep a 1 MiB threshold in memory too, because with freed blocks kept its heap grew by 150-350 MiB
a step with only ~0.3 GiB in use: torch's multi-grad hooks, left on the step's activations, kept a few hundred
small objects alive among them, so freed activations could not be joined again ([Note: multi-grad hooks] in
zero/stage3.py). With the hooks removed at the end of each pass the heap stays flat, as plain PyTorch's does.

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
from dataclasses import dataclass

import torch

from infinity.aio import buffers
from infinity.memory import torch_cpu_allocator

logger = logging.getLogger("infinity")

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers
M_MMAP_THRESHOLD = -3
M_MMAP_MAX = -4
GLIBC_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_")  # the user's, if set
REUSE_SHARE_BYTES = 4 << 30  # with NVMe, a rank's host share from which freed blocks stay (the share at which the
# plan's staging rings have their full budget: memory/plan.py)


@dataclass(frozen=True)
class HeapPolicy:
    """glibc's settings for what happens to a freed block (module docstring)."""

    name: str
    mmap_threshold: int  # blocks from this size up are mapped on their own, and unmapped when freed
    mmap_max: int  # how many such mappings at once: 0, none (every block from the heap)
    trim_threshold: int  # free bytes at the heap's top from which they go back; -1, never


KEEP = HeapPolicy("keep", 32 << 20, 0, -1)
RETURN = HeapPolicy("return", 1 << 20, 65536, 2 << 20)  # 65536: glibc's default mmap_max
PRESSURE_PART = 8  # KEEP gives way when the host's available memory falls under an eighth of the plan's
KEPT_ACTIVATION_COPIES = 2  # what KEEP's heap holds beyond the live blocks, in step activations (for estimates:
# GPT-2 small, fp32, micro batch 4 x 128, world size 1: peak RSS 1.22 GiB above the rest at stage 2 and 1.03 GiB at
# stage 3 with everything on NVMe, for 0.675 GiB of activations)
GROWTH_SLACK_PART = 8  # KEEP's heap may grow by an eighth past its settled size (GROWTH_SLACK_BYTES at least)
GROWTH_SLACK_BYTES = 256 << 20
BUILD = RETURN  # zero.Init: freed parameters go back ([Note: zero.Init memory])
_fixed: HeapPolicy | None = None
_said_huge_pages = False


@functools.cache
def _libc():
    """The C library, looked up once (find_library may run a subprocess)."""
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name or "libc.so.6")
    except OSError:
        return None


SETUP_FREE_BYTES = 1 << 30  # free heap bytes after a stage-3 unit's setup from which its pages are given back


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]  # fmt: skip


def _mallinfo2() -> _MallInfo2 | None:
    """glibc's mallinfo2 (2.33 and later); None where it cannot be read."""
    mallinfo2 = getattr(_libc(), "mallinfo2", None)
    if mallinfo2 is None:
        return None
    mallinfo2.restype = _MallInfo2
    return mallinfo2()


def heap_free_bytes() -> int | None:
    """Bytes free inside the main heap; None where they cannot be read."""
    info = _mallinfo2()
    return None if info is None else int(info.fordblks)


def heap_in_use_bytes() -> int | None:
    """Bytes allocated from the main heap and not yet freed; None where they cannot be read."""
    info = _mallinfo2()
    return None if info is None else int(info.uordblks)


def keeps_freed_blocks() -> bool:
    """Whether the engine's heap policy is KEEP (freed blocks stay in the process)."""
    return _fixed is KEEP


def freed_blocks_reused() -> bool:
    """Whether a block freed now is taken by the next of its size without a fault: KEEP, where the heap puts
    torch's blocks back into their holes ([Note: aligned blocks and glibc] in torch_cpu_allocator.py). Then a
    buffer kept between uses only adds to the peak: the forward's activations could have had its blocks."""
    return _fixed is KEEP and torch_cpu_allocator.holes_reused()


class SetupTrim:
    """[Note: setup memory], one per setup: called after each unit's one-off buffers are freed; under KEEP,
    gives the heap's free pages back each time SETUP_FREE_BYTES more lie free than after the last trim, or than
    before setup (a trim leaves the free chunks in the heap: only their pages go)."""

    def __init__(self) -> None:
        # heap free bytes after the last trim; at first, what lay free before setup (not its one-off buffers)
        self.trimmed_at = heap_free_bytes() or 0

    def __call__(self) -> None:
        if _fixed is not KEEP:
            return
        free = heap_free_bytes()
        if free is not None and free - self.trimmed_at >= SETUP_FREE_BYTES:
            trim_heap()
            self.trimmed_at = free


def trim_heap() -> bool:
    """Gives the heap's free pages back to the kernel (glibc's malloc_trim); False where there is no such call."""
    libc = _libc()
    trim = getattr(libc, "malloc_trim", None)
    return bool(trim is not None and trim(0))


def policy_for(*, on_nvme: bool, host_share: int) -> HeapPolicy:
    """The engine's policy (module docstring): in memory, at any stage, freed blocks stay for reuse; with anything
    on NVMe too where the rank's host share is at least REUSE_SHARE_BYTES, else they go back, so a small host
    budget holds. ``host_share`` is the plan's, the same on every rank of a node."""
    if on_nvme and host_share < REUSE_SHARE_BYTES:
        return RETURN
    return KEEP


@dataclass
class HeapWatch:
    """KEEP's heap across steps: its resident size once the steps have settled, and how far it may grow past it.
    glibc before 2.38 cannot serve an aligned request (torch asks for 64 bytes) from a free hole of exactly the
    request's size, so where torch's allocator is c10's (torch_cpu_allocator.py not built, blocks under 1 MiB)
    now and then a step's block extends the heap while a hole its size lies free (measured before that
    allocator: a stage-3 MLP with 64 MiB activations grew 64 MiB at a time, at steps 11-31 in one run, 97-269 in
    another).
    When the resident size passes the settled one by the slack, the heap's free pages go back (malloc_trim) and the
    size is taken again two steps later: the next step faults its working set in once."""

    settle_steps: int = 2
    baseline: int | None = None  # VmRSS at the end of the settled step
    steps_seen: int = 0
    trims: int = 0

    def after_step(self) -> bool:
        """At the end of each optimizer step; True when it gave the free pages back."""
        if _fixed is not KEEP:
            return False
        self.steps_seen += 1
        if self.steps_seen < self.settle_steps:
            return False
        resident = process_status_bytes("VmRSS")
        if self.baseline is None:
            self.baseline = resident
            return False
        if resident <= self.baseline + max(GROWTH_SLACK_BYTES, self.baseline // GROWTH_SLACK_PART):
            return False
        trim_heap()
        self.trims += 1
        self.baseline, self.steps_seen = None, 0
        return True


def give_back_if_short(available_at_start: int) -> int | None:
    """Under KEEP, where the host's available memory has fallen below 1/PRESSURE_PART of ``available_at_start``
    (what the plan found at initialize): RETURN from now on and the heap's free pages trimmed, so the run goes on
    slower rather than the node running out of memory for blocks it only caches. The available bytes when it gave
    way, else None."""
    if _fixed is not KEEP:
        return None
    available = buffers.available_host_bytes()
    if available >= available_at_start // PRESSURE_PART:
        return None
    fix_heap_policy(RETURN)
    return available


def fix_heap_policy(policy: HeapPolicy) -> bool:
    """Set glibc's allocator to ``policy`` (see the module docstring): ``policy_for`` the engine's steps, BUILD
    while zero.Init builds a model. Leaving KEEP gives its cached free pages back. False where it does not apply:
    another libc, the user chose the settings, or glibc refused one (said once in the log, nothing assumed)."""
    global _fixed
    if any(name in os.environ for name in GLIBC_SETTINGS):
        return False
    if _fixed == policy:
        return True
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None:
        return False
    leaving_keep, _fixed = _fixed is KEEP, None  # unknown until every setting has taken
    settings = ((M_MMAP_MAX, policy.mmap_max), (M_MMAP_THRESHOLD, policy.mmap_threshold),
                (M_TRIM_THRESHOLD, policy.trim_threshold))  # fmt: skip
    refused = [parameter for parameter, value in settings if mallopt(parameter, value) != 1]
    if leaving_keep:
        trim_heap()
    if refused:
        logger.info("glibc refused mallopt parameter(s) %s for the %s heap policy; its own settings stay in part",
                    refused, policy.name)  # fmt: skip
        return False
    _fixed = policy
    logger.debug("glibc heap policy %s: %s", policy.name, policy)
    if policy is KEEP:
        torch_cpu_allocator.install()  # [Note: aligned blocks and glibc]
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
