"""`infinity report`: the environment in one screen, so a slow or failing run can be traced to the machine.

Each check is a small function returning a ``Check`` row: what was found, how it stands and what to do.
Three levels, because most problems only cost speed: OK; WARN (works, but slower or less safe: no
O_DIRECT, no CUDA, THP off, a small memlock limit); BROKEN (training with NVMe offload cannot run: the
compiled I/O core missing, kernel AIO refused, --nvme-path missing or not writable, no way to move bytes
to it). The exit code is 1 when any row is BROKEN, else 0.
"""

from __future__ import annotations

import argparse
import contextlib
import enum
import errno as errno_module
import importlib
import importlib.metadata
import os
import platform
import resource
import shutil
import stat
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass

from infinity.mounts import mount_of  # not under infinity.aio: that package loads the C core

PROBE_BYTES = 4096
"""One direct-I/O block: the smallest aligned write and read the engine issues."""
LOW_MEMLOCK_BYTES = 1 << 30
"""Below this memlock limit, large host I/O buffers cannot be locked (they stay swappable)."""
LOW_FREE_BYTES = 10 << 30
"""Below this much free space on --nvme-path, offloading all but the smallest models will not fit."""
MEMINFO = "/proc/meminfo"
THP_DIR = "/sys/kernel/mm/transparent_hugepage"
NOT_TESTED = "not tested"
"""Starts the value of a check skipped because an earlier one is broken (left out of the summary line)."""


class Level(enum.Enum):
    OK = "ok"
    WARN = "warn"
    BROKEN = "broken"


@dataclass(frozen=True, slots=True)
class Check:
    """One line of the report. ``fix`` says what to do; empty when nothing needs doing."""

    name: str
    value: str
    level: Level = Level.OK
    fix: str = ""

    @property
    def ok(self) -> bool:
        return self.level is Level.OK


def format_bytes(n: int) -> str:
    """Bytes with a binary unit, for reading at a glance (the exact count is shown where it matters)."""
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n} B"


# ---- versions, CUDA, distributed ----


def package_version(name: str) -> str:
    """The installed distribution's version, "not installed" when it is absent."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def check_versions() -> list[Check]:
    import torch

    import infinity

    transformers = package_version("transformers")
    return [
        Check("python", f"{platform.python_version()} ({sys.executable})"),
        Check("torch", torch.__version__),
        Check(
            "transformers",
            transformers,
            Level.WARN if transformers == "not installed" else Level.OK,
            'needed for the Hugging Face models and the examples: pip install -e ".[train]"'
            if transformers == "not installed"
            else "",
        ),
        Check("infinity", f"{infinity.__version__} ({os.path.dirname(infinity.__file__)})"),
    ]


def check_cuda() -> Check:
    import torch

    if not torch.cuda.is_available():
        built = torch.version.cuda
        why = f"torch built with CUDA {built}, but no GPU or driver is visible" if built else "CPU-only torch build"
        return Check(
            "CUDA",
            f"not available ({why})",
            Level.WARN,
            "compute runs on the CPU (slow); for GPUs install a CUDA build of torch and check nvidia-smi",
        )
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return Check("CUDA", f"{torch.version.cuda}, {len(names)} device(s): {', '.join(names)}")


def check_distributed(cuda: bool) -> Check:
    """The backend the engine picks (infinity/distributed.py: NCCL with CUDA, else gloo), if torch has it."""
    import torch.distributed as dist

    if not dist.is_available():
        return Check(
            "distributed",
            "torch.distributed not available",
            Level.WARN,
            "one process only; multi-rank runs need a torch build with distributed support",
        )
    backend = "nccl" if cuda else "gloo"
    has = dist.is_nccl_available() if cuda else dist.is_gloo_available()
    if not has:
        return Check(
            "distributed",
            f"{backend} (what the engine uses here) is not built into this torch",
            Level.WARN,
            "multi-rank runs will fail to join; install a torch build with " + backend,
        )
    gloo = " (gloo too, for the ZeRO-3 fetch headers)" if cuda and dist.is_gloo_available() else ""
    return Check("distributed", f"{backend}{gloo}")


# ---- the compiled I/O core ----


def check_io_core() -> Check:
    """The C core (infinity._aio, built by cffi at install) and the mechanism it was built for."""
    try:
        module = importlib.import_module("infinity._aio")
        backend = module.ffi.string(module.lib.inf_backend()).decode()
    except Exception as e:  # ImportError, or a stale build missing a symbol
        return Check(
            "I/O core",
            f"infinity._aio cannot be loaded ({type(e).__name__}: {e})",
            Level.BROKEN,
            'rebuild it (needs a C compiler): pip install -e . --no-build-isolation, or pip install -e ".[test]"',
        )
    return Check("I/O core", f"infinity._aio loaded, backend {backend}")


def check_kernel_aio() -> Check:
    """io_setup: every AioHandle worker thread owns one kernel AIO context, so without it no handle opens."""
    from infinity.aio import core
    from infinity.errors import AioError

    try:
        context = core.AioContext(1)
    except AioError as e:
        return Check(
            "kernel AIO",
            f"io_setup refused ({errno_module.errorcode.get(e.errno, e.errno)}): {e.detail}",
            Level.BROKEN,
            "raise fs.aio-max-nr (sysctl -w fs.aio-max-nr=1048576); in a container, allow io_setup in its "
            "seccomp profile",
        )
    context.close()
    return Check("kernel AIO", "io_setup works (Linux native AIO)")


# ---- the NVMe folder ----


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def check_nvme_path(path: str) -> Check:
    """The folder exists, is a folder, and a file can be created in it. Never creates the folder."""
    name = "nvme path"
    real = os.path.realpath(path)
    try:
        info = os.stat(path)
    except OSError as e:
        return Check(
            name,
            f"{real} does not exist ({e.strerror})",
            Level.BROKEN,
            f"create it (mkdir -p {path}) on a fast local disk, or pass --nvme-path DIR",
        )
    if not stat.S_ISDIR(info.st_mode):
        return Check(name, f"{real} is not a folder", Level.BROKEN, "pass a folder: --nvme-path DIR")
    mount = mount_of(real)
    where = f"{real} (filesystem {mount.fstype}, mounted at {mount.mount_point})" if mount else real
    probe = os.path.join(path, f".infinity-report-{os.getpid()}")
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as e:
        return Check(
            name,
            f"{where} is not writable ({e.strerror})",
            Level.BROKEN,
            f"make it writable (chown/chmod {path}) or pass --nvme-path a folder you can write",
        )
    os.close(fd)
    os.remove(probe)
    return Check(name, f"{where}, writable")


def filesystem_of(path: str) -> str:
    mount = mount_of(path)
    return mount.fstype if mount else "unknown"


@dataclass(frozen=True, slots=True)
class ProbeResult:
    """What one 4 KiB round trip through the engine's own code found."""

    direct: Check
    buffered: Check


def probe_io(path: str, *, kernel_aio: bool) -> ProbeResult:
    """Write one aligned 4 KiB block to a temp file in ``path`` and read it back, as the engine would:
    opened by infinity.aio.files.open_file (O_DIRECT where the filesystem allows), moved through the C
    core's kernel-AIO loop when O_DIRECT was granted, and through its pread/pwrite fallback always.
    The file is removed afterwards."""
    from infinity.aio import core
    from infinity.aio.buffers import HugePagePolicy, allocate_host_buffer
    from infinity.aio.files import DirectIOFallbackWarning, open_file
    from infinity.errors import AioError

    fs = filesystem_of(path)
    real = os.path.realpath(path)
    probe = os.path.join(path, f".infinity-report-io-{os.getpid()}")
    out = allocate_host_buffer(PROBE_BYTES, huge_pages=HugePagePolicy.NONE, lock=False, pin=False)
    back = allocate_host_buffer(PROBE_BYTES, huge_pages=HugePagePolicy.NONE, lock=False, pin=False)
    out.data.copy_(_pattern(PROBE_BYTES))

    def round_trip(move: Callable[[bool, int], None]) -> None:
        back.data.zero_()
        move(True, out.address)
        move(False, back.address)
        if not bool((back.data == out.data).all()):
            raise AioError(op="read", path=probe, offset=0, errno=None, detail="read back other bytes than written")

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DirectIOFallbackWarning)
            file = open_file(probe, write=True, direct=True, exclusive=True, mode=0o600)
    except AioError as e:
        failed = Check("O_DIRECT", f"cannot create a probe file: {e}", Level.BROKEN, f"check {real} and its disk")
        return ProbeResult(failed, Check("buffered I/O", NOT_TESTED, Level.BROKEN, "fix the O_DIRECT line first"))
    try:
        if file.direct_fd is None:
            direct = Check(
                "O_DIRECT",
                f"refused on {real} (filesystem {fs}): the engine falls back to buffered pread/pwrite",
                Level.WARN,
                "slower and fills the page cache: put nvme_path on a local ext4 or xfs disk",
            )
        elif not kernel_aio:
            direct = Check(
                "O_DIRECT",
                f"{NOT_TESTED}: no kernel AIO (O_DIRECT opens on {real}, filesystem {fs})",
                Level.BROKEN,
                "fix kernel AIO first",
            )
        else:
            context = core.AioContext(1)
            loop = core.LoopSettings(block_size=PROBE_BYTES, queue_depth=1, single_submit=False, overlap_events=True)
            try:
                round_trip(
                    lambda is_write, address: core.rw_direct(
                        context,
                        file.direct_fd,
                        is_write=is_write,
                        address=address,
                        nbytes=PROBE_BYTES,
                        offset=0,
                        settings=loop,
                        path=probe,
                        timeout_s=30.0,
                        keep_alive=(out, back),  # the kernel may still use them after a timeout
                    )
                )
                direct = Check("O_DIRECT", f"works on {real} (filesystem {fs}): 4 KiB written and read via kernel AIO")
            except AioError as e:
                direct = Check(
                    "O_DIRECT",
                    f"opens on {real} (filesystem {fs}) but a 4 KiB transfer failed: {e}",
                    Level.WARN,
                    'set "aio": {"use_direct_io": false} or put nvme_path on a local ext4 or xfs disk',
                )
            finally:
                context.close()
        try:
            round_trip(
                lambda is_write, address: core.rw_buffered(
                    file.buffered_fd, is_write=is_write, address=address, nbytes=PROBE_BYTES, offset=0, path=probe
                )
            )
            buffered = Check("buffered I/O", "pread/pwrite fallback works (4 KiB written and read)")
        except AioError as e:
            buffered = Check(
                "buffered I/O",
                f"pread/pwrite failed: {e}",
                Level.BROKEN if not direct.ok else Level.WARN,
                f"check the disk under {real} (dmesg, free space)",
            )
    finally:
        file.close()
        with contextlib.suppress(OSError):
            os.remove(probe)
        out.release()
        back.release()
    return ProbeResult(direct, buffered)


def _pattern(n: int):
    import torch

    return torch.arange(n, dtype=torch.int64).remainder(251).to(torch.uint8)


def check_free_space(path: str) -> Check:
    usage = shutil.disk_usage(path)
    value = f"{format_bytes(usage.free)} free of {format_bytes(usage.total)}"
    if usage.free < LOW_FREE_BYTES:
        return Check(
            "free space",
            value,
            Level.WARN,
            "offloaded states need about 16 bytes per parameter (fp32 Adam): free space or use another --nvme-path",
        )
    return Check("free space", value)


# ---- host memory ----


def memlock_limit() -> int | None:
    """The soft RLIMIT_MEMLOCK in bytes; None when unlimited."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return None if soft == resource.RLIM_INFINITY else soft


def check_memlock() -> Check:
    limit = memlock_limit()
    if limit is None:
        return Check("memlock limit", "unlimited")
    value = f"{limit} bytes ({format_bytes(limit)})"
    if limit < LOW_MEMLOCK_BYTES:
        return Check(
            "memlock limit",
            value,
            Level.WARN,
            "host I/O buffers beyond it stay unlocked (the kernel may swap them): ulimit -l unlimited, "
            "LimitMEMLOCK=infinity for a service, --ulimit memlock=-1 for docker",
        )
    return Check("memlock limit", value)


def check_pinning(cuda: bool) -> Check:
    """Lock one small host buffer the way the engine does (infinity.aio.buffers.allocate_host_buffer):
    cudaHostRegister with CUDA, else mlock."""
    try:
        from infinity.aio.buffers import HugePagePolicy, allocate_host_buffer
    except ImportError as e:  # the package imports the I/O core; its own row says why it is missing
        return Check("pinned memory", f"{NOT_TESTED}: {e}", Level.WARN, "rebuild the I/O core (see above)")

    how = "cudaHostRegister" if cuda else "mlock"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)  # the engine's once-per-process warning
            buffer = allocate_host_buffer(PROBE_BYTES, huge_pages=HugePagePolicy.NONE, lock=True, pin=cuda)
    except Exception as e:
        return Check("pinned memory", f"{how} failed: {e}", Level.WARN, "raise the memlock limit (see above)")
    done = buffer.pinned if cuda else buffer.locked
    buffer.release()
    if not done:
        return Check(
            "pinned memory",
            f"{how} of {PROBE_BYTES} bytes failed",
            Level.WARN,
            "host buffers stay pageable (slower copies, may be swapped): raise the memlock limit",
        )
    return Check("pinned memory", f"works ({how})")


def bracketed(text: str) -> str | None:
    """The selected value of a sysfs choice file: "always [madvise] never" -> "madvise"."""
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else None


def check_thp() -> list[Check]:
    """The engine's buffers ask for huge pages with MADV_HUGEPAGE; "never" turns that off."""
    enabled = bracketed(_read(os.path.join(THP_DIR, "enabled")))
    defrag = bracketed(_read(os.path.join(THP_DIR, "defrag")))
    rows = []
    for name, value in (("THP enabled", enabled), ("THP defrag", defrag)):
        key = name.split()[1]
        if value is None:
            rows.append(Check(name, "unknown (no transparent huge pages in this kernel)", Level.WARN,
                              "I/O buffers use 4 KiB pages: O_DIRECT moves more, smaller segments"))  # fmt: skip
        elif value == "never":
            rows.append(Check(name, value, Level.WARN,
                              f"echo madvise > {THP_DIR}/{key} (as root) for huge-page I/O buffers"))  # fmt: skip
        else:
            rows.append(Check(name, value))
    return rows


def check_cpus() -> Check:
    usable = len(os.sched_getaffinity(0))
    return Check("CPUs", f"{usable} usable (sched_getaffinity) of {os.cpu_count()} (cpu_count)")


def meminfo_bytes(text: str, key: str) -> int | None:
    for line in text.splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return None


def check_ram() -> Check:
    text = _read(MEMINFO)
    total, available = meminfo_bytes(text, "MemTotal"), meminfo_bytes(text, "MemAvailable")
    if total is None or available is None:
        return Check("RAM", f"unknown ({MEMINFO} unreadable)", Level.WARN, "")
    return Check("RAM", f"{format_bytes(total)} total, {format_bytes(available)} available")


# ---- putting it together ----


def gather(nvme_path: str) -> list[Check]:
    """Every check, in the order printed. Later checks are skipped (BROKEN, NOT_TESTED) when what they
    need is missing, so one cause is not reported five times."""
    import torch

    rows = check_versions()
    cuda = torch.cuda.is_available()
    rows += [check_cuda(), check_distributed(cuda)]
    core = check_io_core()
    rows.append(core)
    kernel = check_kernel_aio() if core.ok else Check("kernel AIO", f"{NOT_TESTED}: no I/O core", Level.BROKEN,
                                                      "fix the I/O core first")  # fmt: skip
    rows.append(kernel)
    folder = check_nvme_path(nvme_path)
    rows.append(folder)
    if folder.ok and core.ok:
        probe = probe_io(nvme_path, kernel_aio=kernel.ok)
        rows += [probe.direct, probe.buffered]
    else:
        need = "fix --nvme-path first" if not folder.ok else "fix the I/O core first"
        rows += [Check("O_DIRECT", NOT_TESTED, Level.BROKEN, need),
                 Check("buffered I/O", NOT_TESTED, Level.BROKEN, need)]  # fmt: skip
    if folder.ok:
        rows.append(check_free_space(nvme_path))
    rows += [check_memlock(), check_pinning(cuda), *check_thp(), check_cpus(), check_ram()]
    return rows


MARKS = {Level.OK: " ", Level.WARN: "!", Level.BROKEN: "X"}


def render(rows: list[Check]) -> str:
    """ "name: value" lines aligned on the colon; a mark (! slower, X broken) and a "fix:" line under
    each row that needs one; a last line with the verdict."""
    width = max(len(r.name) for r in rows) + 1
    lines = []
    for row in rows:
        lines.append(f"{MARKS[row.level]} {row.name + ':':<{width}} {row.value}")
        if not row.ok and row.fix:
            lines.append(f"  {'':<{width}} fix: {row.fix}")
    broken = [r for r in rows if r.level is Level.BROKEN and not r.value.startswith(NOT_TESTED)]
    warnings_count = sum(r.level is Level.WARN for r in rows)
    if broken:
        lines.append("broken: " + "; ".join(f"{r.name}: {r.value}" for r in broken))
    else:
        slower = f" ({warnings_count} warning(s) marked !, each with its fix)" if warnings_count else ""
        lines.append(f"ok: everything needed works{slower}")
    return "\n".join(lines)


def exit_code(rows: list[Check]) -> int:
    return 1 if any(r.level is Level.BROKEN for r in rows) else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="infinity report",
        description="Check the environment for training with infinity: versions, CUDA, the I/O core, the NVMe "
        "folder (filesystem, O_DIRECT, free space), memlock, huge pages, CPUs and RAM. Exit 1 when something "
        "needed is broken.",
    )
    parser.add_argument("--nvme-path", default=".", metavar="DIR",
                        help="the folder you will offload to (default: the current folder); never created")  # fmt: skip
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    rows = gather(args.nvme_path)
    print(render(rows))
    return exit_code(rows)
