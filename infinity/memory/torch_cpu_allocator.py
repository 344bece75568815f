"""torch's CPU allocator where glibc's aligned allocation wastes the heap: built once, installed under KEEP.

[Note: aligned blocks and glibc]
c10's CPU allocator asks posix_memalign for 64-byte alignment. glibc before 2.38 serves an aligned request by
asking its heap for the size plus the alignment plus a minimum chunk (2.38 first looks for a free chunk that is
already aligned), so a freed block is not reused by the next request of the same size while it lies between
blocks in use: under KEEP, where every freed block stays in the heap, the heap grows past such holes. Measured
(GPT-2 small, bf16, world size 1, peers benchmark settings, glibc 2.36, mallinfo2 after step 4): stage 3 in
memory 5.43 GiB of heap for 3.33 GiB at most in use, peak RSS 5.63 GiB; with torch's blocks of 1 MiB and more
asked of plain malloc, 3.85 GiB of heap and 4.09 GiB peak RSS at the same step time (1.69-1.78 s); stage 2 4.86
against 4.11 GiB, stage 3 with cpu offload 5.27 against 4.08 GiB.

So where glibc is older than 2.38 and the engine sets KEEP, ``install`` makes torch's CPU allocator one that
asks malloc for the size plus 80 bytes, aligns the pointer it hands out and keeps a mark and malloc's pointer
just below it (torch_cpu_allocator.cpp). It is compiled against the installed torch's headers with the system's
C++ compiler on first use (a few seconds) into a per-user cache keyed by the source, torch's version and the
compiler, and stays torch's CPU allocator for the rest of the process: blocks made before keep c10's deleter,
blocks below 1 MiB stay c10's, and a raw block of c10's freed through it (oneDNN takes its scratch blocks raw)
goes back to c10's deleter. Where there is no compiler, or the build fails, the engine says so once and runs
with c10's (more heap, nothing else). ``INFINITY_TORCH_CPU_ALLOCATOR=c10`` keeps c10's; a user who preloads
another allocator (jemalloc, tcmalloc, mimalloc) or sets glibc's variables keeps theirs.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shlex
import shutil
import subprocess
import tempfile
from dataclasses import dataclass

import torch

logger = logging.getLogger("infinity")

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torch_cpu_allocator.cpp")
THRESHOLD_BYTES = 1 << 20  # blocks from this size up are malloc's (the measured setting)
FIXED_GLIBC = (2, 38)  # glibc from which an aligned request reuses an aligned free chunk
SETTING = "INFINITY_TORCH_CPU_ALLOCATOR"  # "c10": keep torch's own
OTHER_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")
BUILD_TIMEOUT_S = 300


def glibc_version() -> tuple[int, int] | None:
    """The running glibc's (major, minor); None under another C library."""
    try:
        text = os.confstr("CS_GNU_LIBC_VERSION")  # "glibc 2.36"
    except (ValueError, OSError):
        return None
    if not text or not text.startswith("glibc "):
        return None
    try:
        major, minor = text.split()[1].split(".")[:2]
        return int(major), int(minor)
    except ValueError:
        return None


def _preloaded_allocator() -> bool:
    return any(name in os.environ.get("LD_PRELOAD", "") for name in OTHER_ALLOCATORS)


def needed() -> str | None:
    """Why the allocator is not needed (or not wanted) in this process; None where it is. (A malloc that is not
    glibc's, preloaded or linked in, is found when the built allocator is loaded.)"""
    if os.environ.get(SETTING, "").lower() == "c10":
        return f"{SETTING}=c10"
    if os.environ.get("THP_MEM_ALLOC_ENABLE", "0") not in ("", "0"):
        return "THP_MEM_ALLOC_ENABLE asks c10's allocator for huge-page blocks"  # [Note: huge pages] in host.py
    if _preloaded_allocator():
        return "another allocator is preloaded"
    version = glibc_version()
    if version is None:
        return "the C library is not glibc"
    if version >= FIXED_GLIBC:
        return f"glibc {version[0]}.{version[1]} reuses aligned holes"
    return None


def _compiler() -> list[str] | None:
    """$CXX (with its arguments, e.g. `ccache g++`), else c++ or g++; None where none is found."""
    wanted = shlex.split(os.environ.get("CXX", ""))
    if wanted:
        found = shutil.which(wanted[0])
        return [found, *wanted[1:]] if found else None
    found = shutil.which("c++") or shutil.which("g++")
    return [found] if found else None


def _torch_lib_dir() -> str:
    return os.path.join(os.path.dirname(torch.__file__), "lib")


def _cache_dir() -> str:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "infinity")


def _flags() -> list[str]:
    include = os.path.join(os.path.dirname(torch.__file__), "include")
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return ["-O2", "-std=c++17", "-shared", "-fPIC", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-isystem", include,
            SOURCE, "-L", _torch_lib_dir(), "-lc10", f"-Wl,-rpath,{_torch_lib_dir()}"]  # fmt: skip


def library_path(compiler: list[str]) -> str:
    """Where the build for this source, torch, compiler and flags lives."""
    with open(SOURCE, "rb") as f:
        key = hashlib.sha256(f.read())
    key.update(f"{torch.__version__}|{torch.__file__}|{os.path.realpath(compiler[0])}".encode())
    key.update(" ".join(compiler[1:] + _flags()).encode())
    return os.path.join(_cache_dir(), f"torch_cpu_allocator-{key.hexdigest()[:16]}.so")


def build(compiler: list[str], target: str) -> None:
    """Compiles the allocator to ``target`` (written beside it, then renamed: ranks building at once are safe).
    Raises RuntimeError with the compiler's message."""
    os.makedirs(os.path.dirname(target), exist_ok=True)
    fd, partial = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=os.path.dirname(target))
    os.close(fd)
    command = [*compiler, *_flags(), "-o", partial]
    try:
        done = subprocess.run(command, capture_output=True, text=True, errors="replace", timeout=BUILD_TIMEOUT_S,
                              check=False)  # fmt: skip
        if done.returncode != 0:
            name = os.path.basename(compiler[0])
            raise RuntimeError(f"{name} exited with {done.returncode}: {done.stderr[-2000:]}")
        os.replace(partial, target)
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"the build took more than {BUILD_TIMEOUT_S} s") from e
    finally:
        if os.path.exists(partial):
            os.unlink(partial)


_FUNCTIONS = {  # name: (argument types, result type)
    "infinity_install_cpu_allocator": ([ctypes.c_size_t], ctypes.c_int),
    "infinity_cpu_allocator_is_current": ([], ctypes.c_int),
    "infinity_malloc_is_glibc": ([], ctypes.c_int),
    "infinity_block_is_malloc_backed": ([ctypes.c_void_p], ctypes.c_int),
    "infinity_raw_blocks_round_trip": ([], ctypes.c_int),
}


@dataclass
class _State:
    library: ctypes.CDLL | None = None
    failure: str | None = None  # why it could not be built or loaded: not tried again in this process
    installed: bool = False


_state = _State()


def _library() -> ctypes.CDLL:
    """The built allocator, loaded (built first where this source, torch and compiler have no build yet). Raises
    RuntimeError saying why not, once per process: a failed build is not tried again."""
    if _state.library is not None:
        return _state.library
    if _state.failure is not None:
        raise RuntimeError(_state.failure)
    try:
        compiler = _compiler()
        if compiler is None:
            raise RuntimeError("no C++ compiler (c++ or g++, or $CXX) to build it with")
        path = library_path(compiler)
        if not os.path.exists(path):
            build(compiler, path)
        try:
            library = ctypes.CDLL(path)
        except OSError as e:
            raise RuntimeError(f"its build {path} could not be loaded ({e}): remove it to build it again") from e
        for name, (arguments, result) in _FUNCTIONS.items():
            function = getattr(library, name)
            function.argtypes, function.restype = arguments, result
    except (OSError, RuntimeError, AttributeError) as e:
        _state.failure = str(e)
        raise RuntimeError(_state.failure) from e
    _state.library = library
    return library


def install() -> bool:
    """[Note: aligned blocks and glibc]: torch's CPU allocator becomes the malloc-backed one where it is needed.
    True where it is installed (now or before); False where it is not needed, or could not be built (said once)."""
    if _state.installed:
        return True
    if needed() is not None or _state.failure is not None:
        return False
    try:
        library = _library()
    except RuntimeError as e:
        logger.info("torch's CPU blocks stay posix_memalign's (glibc before 2.38 does not reuse a freed hole of "
                    "their size, so the heap holds more): the allocator that avoids it is not available: %s", e)
        return False
    if not library.infinity_malloc_is_glibc():
        _state.failure = "malloc is not glibc's"
        return False
    _state.installed = bool(library.infinity_install_cpu_allocator(THRESHOLD_BYTES))
    if not _state.installed:
        _state.failure = "another library set torch's CPU allocator with a higher priority"
        logger.info("torch's CPU allocator stays another library's (set with a higher priority)")
    return _state.installed


def holes_reused() -> bool:
    """Whether a freed torch block's hole is taken by the next block of its size: glibc 2.38 or later does it
    itself; older glibc where this allocator is installed."""
    version = glibc_version()
    glibc_reuses = version is not None and version >= FIXED_GLIBC
    return (glibc_reuses and not _preloaded_allocator()) or installed()


def installed() -> bool:
    """Whether torch's CPU allocator is this one now."""
    return _state.library is not None and bool(_state.library.infinity_cpu_allocator_is_current())


def block_is_malloc_backed(tensor: torch.Tensor) -> bool:
    """Whether a CPU tensor's storage came from the installed allocator (tests)."""
    if _state.library is None:
        return False
    return bool(_state.library.infinity_block_is_malloc_backed(tensor.untyped_storage().data_ptr()))


def raw_blocks_round_trip() -> bool:
    """Raw blocks taken and given back through torch's CPU allocator, as oneDNN does (tests)."""
    return bool(_library().infinity_raw_blocks_round_trip())
