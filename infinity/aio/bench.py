"""`infinity aio-bench`: how fast is my disk through this engine, and which `aio` settings should I use?

Measures read and write throughput of one file through the engine for every combination of the given
settings, optionally side by side with fio on the same file (`--vs-fio`), and with `--tune` prints a
ready-to-paste `"aio"` block. GB/s means 1e9 bytes per second.

Honesty rules: reads never come from the page cache (O_DIRECT, or with --buffered the file's pages are
dropped before each read); writes are timed to durable completion (O_DIRECT completion, or fsync).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

from infinity.aio import core
from infinity.aio.buffers import HUGE_PAGE_BYTES, HostBuffer, allocate_host_buffer
from infinity.aio.files import fsync_path
from infinity.aio.handle import AioHandle, AioSettings
from infinity.errors import ConfigError, InfinityError
from infinity.mounts import mount_of

GB = 1e9
_SIZE_RE = re.compile(r"^\s*(\d+)\s*([KMGT]?)(?:i?B)?\s*$", re.IGNORECASE)
_SUFFIX = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


class BenchError(InfinityError):
    """The benchmark cannot run as asked (folder, free space, options)."""


# ---- parsing ----


def parse_size(text: str) -> int:
    """'4G' -> 4 GiB. Suffixes K, M, G, T are binary (1K = 1024); a bare number is bytes."""
    match = _SIZE_RE.match(str(text))
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: use a whole number with K, M, G or T")
    value = int(match.group(1)) * _SUFFIX[match.group(2).upper()]
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive, got {text!r}")
    return value


def parse_block_sizes(text: str) -> list[int]:
    sizes = [parse_size(part) for part in str(text).split(",")]
    for size in sizes:
        if size % 4096:
            raise argparse.ArgumentTypeError(f"block size {size} is not a multiple of 4096 bytes (direct I/O)")
    return sizes


def parse_positive_ints(text: str) -> list[int]:
    values = []
    for part in str(text).split(","):
        try:
            value = int(part)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{part!r} is not a whole number") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"values must be >= 1, got {value}")
        values.append(value)
    return values


def parse_positive_int(text: str) -> int:
    (value,) = parse_positive_ints(text) if "," not in str(text) else (None,)
    if value is None:
        raise argparse.ArgumentTypeError(f"expected one whole number, got {text!r}")
    return value


# --tune's grid: every combination, for each op measured.
TUNE_BLOCK_SIZES = (512 << 10, 1 << 20, 4 << 20)
TUNE_QUEUE_DEPTHS = (8, 32)
TUNE_INTRA_OP_PARALLELISM = (1, 2)
TUNE_SINGLE_SUBMIT = (False, True)
TUNE_SETTINGS = (
    len(TUNE_BLOCK_SIZES) * len(TUNE_QUEUE_DEPTHS) * len(TUNE_INTRA_OP_PARALLELISM) * len(TUNE_SINGLE_SUBMIT)
)
DEFAULT_IO_SIZE = "4G"
DEFAULT_LOOPS = 3
DEFAULT_WARMUP = 1


def tune_write_bytes(io_size: int, warmup: int, loops: int, reads: bool = True) -> int:
    """Bytes a --tune run writes: every setting's passes, plus the file written once for the reads."""
    return TUNE_SETTINGS * (warmup + loops) * io_size + (io_size if reads else 0)


def _tune_help() -> str:
    """--tune's help: the grid and what it writes, from the same constants the sweep uses."""
    default = parse_size(DEFAULT_IO_SIZE)
    small = 256 << 20
    sizes = ",".join(format_size(size) for size in TUNE_BLOCK_SIZES)
    depths = ",".join(map(str, TUNE_QUEUE_DEPTHS))
    threads = ",".join(map(str, TUNE_INTRA_OP_PARALLELISM))
    return (
        f"sweep {TUNE_SETTINGS} settings per op (block-size {sizes} x queue-depth {depths} x "
        f"intra-op-parallelism {threads} x single-submit off,on; the options that set these are ignored) "
        f'and print the best "aio" block. It writes {TUNE_SETTINGS} x (warmup + loops) x io-size, plus '
        f"io-size once for the reads: {_gib(tune_write_bytes(default, DEFAULT_WARMUP, DEFAULT_LOOPS))} with "
        f"the defaults, {_gib(tune_write_bytes(small, DEFAULT_WARMUP, DEFAULT_LOOPS))} with --io-size 256M "
        "(default: off)"
    )


def _gib(n: int) -> str:
    return f"{n / (1 << 30):g} GiB"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="infinity aio-bench",
        description="Measure read/write throughput of a file through infinity's async I/O engine. Sizes take "
        "K, M, G or T (binary: 1K = 1024); a comma list (e.g. --block-size 1M,4M) sweeps every combination. "
        "GB/s means 1e9 bytes per second.",
    )
    parser.add_argument(
        "--folder",
        default=None,
        help="folder on the disk to measure; the test file goes in a temporary subfolder of it, removed at the "
        "end (default: the current folder)",
    )
    parser.add_argument(
        "--io-size",
        type=parse_size,
        default=parse_size(DEFAULT_IO_SIZE),
        help=f"bytes each pass reads or writes: the size of the test file (default: {DEFAULT_IO_SIZE})",
    )
    ops = parser.add_mutually_exclusive_group()
    ops.add_argument(
        "--read",
        dest="ops",
        action="store_const",
        const=("read",),
        help="measure reads only (the file is written once first, untimed)",
    )
    ops.add_argument("--write", dest="ops", action="store_const", const=("write",), help="measure writes only")
    ops.add_argument(
        "--both",
        dest="ops",
        action="store_const",
        const=("write", "read"),
        help="measure writes, then reads (the default when none of --read, --write, --both is given)",
    )
    parser.add_argument(
        "--block-size",
        type=parse_block_sizes,
        default=[1 << 20],
        help="bytes per request, a multiple of 4096, e.g. 1M or 1M,4M (default: 1M)",
    )
    parser.add_argument(
        "--queue-depth",
        type=parse_positive_ints,
        default=[8],
        help="requests in flight per thread, e.g. 8 or 8,32 (default: 8)",
    )
    parser.add_argument(
        "--intra-op-parallelism",
        type=parse_positive_ints,
        default=[1],
        help="threads that split each pass, e.g. 1 or 1,2 (default: 1)",
    )
    parser.add_argument(
        "--single-submit", action="store_true", help="one request per io_submit call (default: off, batches)"
    )
    parser.add_argument(
        "--no-overlap-events",
        action="store_true",
        help="submit a batch, reap it all, repeat (default: off, new requests go in as others complete)",
    )
    parser.add_argument(
        "--loops",
        type=parse_positive_int,
        default=DEFAULT_LOOPS,
        help=f"timed passes per setting; the table shows their median, min and max (default: {DEFAULT_LOOPS})",
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=DEFAULT_WARMUP,
        help=f"untimed passes per setting before the timed ones (default: {DEFAULT_WARMUP})",
    )
    parser.add_argument(
        "--buffered",
        action="store_true",
        help="no O_DIRECT (through the page cache), for comparison; reads still come from the disk (default: off)",
    )
    parser.add_argument(
        "--buffer-size",
        type=parse_size,
        default=None,
        help="host memory the request streams through; fio uses block-size x queue-depth per thread "
        "(default: io-size, one tensor)",
    )
    parser.add_argument("--tune", action="store_true", help=_tune_help())
    parser.add_argument(
        "--vs-fio",
        action="store_true",
        help="run fio on the same file after each of our runs; needs fio on PATH (default: off)",
    )
    parser.add_argument(
        "--json",
        dest="json_path",
        default=None,
        help="also write the results as JSON to this file, checked before measuring (default: none)",
    )
    parser.add_argument(
        "--plot",
        dest="plot_path",
        default=None,
        help="also write a PNG bar chart to this file, checked before measuring; needs matplotlib (default: none)",
    )
    parser.set_defaults(ops=("write", "read"))
    return parser


# ---- what is measured ----


@dataclass(frozen=True, slots=True)
class Case:
    op: str  # "read" | "write"
    block_size: int
    queue_depth: int
    intra_op_parallelism: int
    single_submit: bool
    overlap_events: bool
    buffered: bool

    @property
    def settings(self) -> AioSettings:
        return AioSettings(
            block_size=self.block_size,
            queue_depth=self.queue_depth,
            intra_op_parallelism=self.intra_op_parallelism,
            single_submit=self.single_submit,
            overlap_events=self.overlap_events,
            use_direct_io=not self.buffered,
        )

    def aio_block(self) -> dict:
        return {
            "block_size": self.block_size,
            "queue_depth": self.queue_depth,
            "intra_op_parallelism": self.intra_op_parallelism,
            "single_submit": self.single_submit,
            "overlap_events": self.overlap_events,
        }

    def label(self) -> str:
        return (
            f"{self.op} bs={format_size(self.block_size)} qd={self.queue_depth} "
            f"t={self.intra_op_parallelism}{' ss' if self.single_submit else ''}"
            f"{' no-ov' if not self.overlap_events else ''}{' buffered' if self.buffered else ''}"
        )


@dataclass(slots=True)
class Row:
    case: Case
    gbps: list[float]
    fio: dict[str, float | None] = field(default_factory=dict)  # iomem mode -> GB/s median
    fio_notes: list[str] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.gbps)

    @property
    def fio_best(self) -> float | None:
        values = [v for v in self.fio.values() if v]
        return max(values) if values else None

    @property
    def ratio(self) -> float | None:
        best = self.fio_best
        return self.median / best if best else None

    def as_json(self) -> dict:
        return {
            **asdict(self.case),
            "gbps": self.gbps,
            "median_gbps": self.median,
            "min_gbps": min(self.gbps),
            "max_gbps": max(self.gbps),
            "fio_gbps": self.fio,
            "ratio_vs_best_fio": self.ratio,
            "fio_notes": self.fio_notes,
        }


def format_size(n: int) -> str:
    for suffix, unit in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n % unit == 0:
            return f"{n // unit}{suffix}"
    return str(n)


def expand_cases(args: argparse.Namespace) -> list[Case]:
    if args.tune:
        grid = itertools.product(TUNE_BLOCK_SIZES, TUNE_QUEUE_DEPTHS, TUNE_INTRA_OP_PARALLELISM, TUNE_SINGLE_SUBMIT)
        return [Case(op, bs, qd, t, ss, True, args.buffered) for bs, qd, t, ss in grid for op in args.ops]
    return [
        Case(op, bs, qd, t, args.single_submit, not args.no_overlap_events, args.buffered)
        for bs, qd, t in itertools.product(args.block_size, args.queue_depth, args.intra_op_parallelism)
        for op in args.ops
    ]


# ---- the test file and its location ----


def describe_location(folder: str) -> dict:
    """Device, filesystem and mount point of ``folder``, and whether it accepts O_DIRECT."""
    real = os.path.realpath(folder)
    mount = mount_of(real)
    probe = os.path.join(folder, f".infinity-odirect-probe-{os.getpid()}")
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
        os.close(fd)
        direct = True
    except OSError:
        direct = False
    finally:
        with contextlib.suppress(OSError):
            os.remove(probe)
    return {"folder": real, "mount_point": mount.mount_point if mount else "", "filesystem": mount.fstype if mount
            else "?", "device": mount.source if mount else "?", "direct_io": direct}  # fmt: skip


def check_folder(folder: str, io_size: int) -> None:
    if not os.path.isdir(folder):
        raise BenchError(f"--folder {folder!r} does not exist or is not a directory; create it first")
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise BenchError(f"--folder {folder!r} is not writable ({e.strerror}); pick a folder you can write") from None
    margin = 64 << 20
    free = shutil.disk_usage(folder).free
    if free < io_size + margin:
        raise BenchError(
            f"--folder {folder!r} has {free / GB:.2f} GB free, but the test file needs --io-size "
            f"{io_size / GB:.2f} GB + {margin / GB:.2f} GB margin; free space or lower --io-size"
        )


def check_output_path(option: str, path: str | None, *, needs_matplotlib: bool = False) -> None:
    """Refuse a --json/--plot path before measuring: failing only when saving would lose the whole run.

    Writability is asked of the kernel (access(2), which also answers for read-only mounts), so the check
    leaves no file behind.
    """
    if path is None:
        return
    target = os.path.abspath(path)
    parent = os.path.dirname(target)
    if os.path.isdir(target):
        raise BenchError(f"{option} {path!r} is a directory; give a file name inside it")
    if not os.path.isdir(parent):
        what = "is not a folder" if os.path.exists(parent) else "does not exist"
        raise BenchError(f"{option} {path!r}: its folder {parent!r} {what}; create it first or pick another path")
    if os.path.exists(target):
        if not os.access(target, os.W_OK):
            raise BenchError(f"{option} {path!r} exists and is not writable; pick another path")
    elif not os.access(parent, os.W_OK | os.X_OK):
        raise BenchError(f"{option} {path!r}: its folder {parent!r} is not writable; pick a folder you can write")
    if needs_matplotlib:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise BenchError(
                f"{option} needs matplotlib, which is not installed: pip install matplotlib "
                "(or this package's [bench] extra), or drop the option"
            ) from None


def drop_page_cache(path: str) -> None:
    """Flush and evict the file's pages so the next buffered read comes from the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


# ---- our engine ----


class Engine:
    """Runs one timed pass of a case through the engine, reusing one host buffer for every case."""

    def __init__(self, path: str, io_size: int, buffer_bytes: int) -> None:
        self.path = path
        self.io_size = io_size
        self.buffer_bytes = min(buffer_bytes, io_size)
        self.buffer: HostBuffer = allocate_host_buffer(self.buffer_bytes)
        self._handles: dict[AioSettings, AioHandle] = {}

    def close(self) -> None:
        for handle in self._handles.values():
            handle.close()
        self._handles.clear()
        self.buffer.release()

    def _handle(self, settings: AioSettings) -> AioHandle:
        if settings not in self._handles:
            self._handles[settings] = AioHandle.from_settings(settings)
        return self._handles[settings]

    def run(self, case: Case) -> float:
        """One pass; returns GB/s. Reads of a buffered file are preceded by dropping its pages."""
        if case.op == "read" and case.buffered:
            drop_page_cache(self.path)
        start = time.perf_counter()
        if self.buffer_bytes >= self.io_size:
            handle = self._handle(case.settings)
            tensor = self.buffer.data[: self.io_size]
            (handle.sync_pwrite if case.op == "write" else handle.sync_pread)(tensor, self.path)
        else:
            self._run_streaming(case)
        if case.op == "write" and case.buffered:
            fsync_path(self.path)
        return self.io_size / (time.perf_counter() - start) / GB

    def _run_streaming(self, case: Case) -> None:
        """fio's memory footprint: each thread streams its slice of the file through its own ring."""
        if case.buffered:
            raise BenchError("--buffer-size smaller than --io-size needs direct I/O; drop --buffered")
        threads = case.intra_op_parallelism
        ring = case.block_size * case.queue_depth  # one slot per request in flight, as fio allocates
        if ring * threads > self.buffer_bytes:
            raise BenchError(
                f"--buffer-size {self.buffer_bytes} cannot hold {threads} rings of queue-depth "
                f"{case.queue_depth} x block-size {case.block_size}; raise --buffer-size"
            )
        slice_bytes = self.io_size // threads
        flags = (os.O_WRONLY | os.O_CREAT) if case.op == "write" else os.O_RDONLY
        fd = os.open(self.path, flags | os.O_DIRECT, 0o644)
        settings = case.settings.loop

        def one(index: int) -> None:
            context = core.AioContext(case.queue_depth)
            try:
                core.rw_direct(
                    context,
                    fd,
                    is_write=case.op == "write",
                    address=self.buffer.address + index * ring,
                    nbytes=slice_bytes,
                    offset=index * slice_bytes,
                    settings=settings,
                    path=self.path,
                    buffer_wrap=ring,
                )
            finally:
                context.close()

        try:
            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(one, range(threads)))
        finally:
            os.close(fd)

    def prepare_file(self) -> None:
        """Reads need the whole file on disk: write it once, untimed."""
        self.run(Case("write", 1 << 20, 8, 1, False, True, False))


# ---- fio ----


class HugePageReservation:
    """Reserves 2 MiB pages for fio's --iomem=shmhuge (root only); restores the old count on exit."""

    def __init__(self, pages: int) -> None:
        self.pages = pages
        self.original: int | None = None
        self.note = ""

    def __enter__(self) -> HugePageReservation:
        path = "/proc/sys/vm/nr_hugepages"
        try:
            with open(path) as f:
                self.original = int(f.read())
            free = _meminfo_value("HugePages_Free")
            if free < self.pages:
                if os.geteuid() != 0:
                    self.note = "huge-page fio run skipped: reserving huge pages needs root"
                    self.original = None
                    return self
                with open(path, "w") as f:
                    f.write(str(self.original + self.pages - free))
            if _meminfo_value("HugePages_Free") < self.pages:
                self.note = "huge-page fio run skipped: the kernel could not reserve enough huge pages"
        except OSError as e:
            self.note = f"huge-page fio run skipped: {e}"
            self.original = None
        return self

    @property
    def available(self) -> bool:
        return not self.note

    def __exit__(self, *exc) -> None:
        if self.original is not None and os.geteuid() == 0:
            with contextlib.suppress(OSError), open("/proc/sys/vm/nr_hugepages", "w") as f:
                f.write(str(self.original))


def _meminfo_value(key: str) -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def fio_pages_needed(cases: list[Case]) -> int:
    most = max(c.block_size * c.queue_depth * c.intra_op_parallelism for c in cases)
    return most // HUGE_PAGE_BYTES + 4 * max(c.intra_op_parallelism for c in cases) + 4


def run_fio(path: str, case: Case, io_size: int, iomem: str) -> float:
    """One fio pass with the same file, block size, queue depth and threads (numjobs); GB/s."""
    jobs = case.intra_op_parallelism
    per_job = io_size // jobs // case.block_size * case.block_size
    command = [
        "fio", "--name=infinity-vs-fio", f"--filename={path}", f"--size={per_job}",
        f"--offset_increment={per_job}", f"--numjobs={jobs}", f"--bs={case.block_size}",
        f"--iodepth={case.queue_depth}", "--ioengine=libaio", "--direct=1", f"--rw={case.op}",
        f"--iomem={iomem}", "--group_reporting", "--output-format=json",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise BenchError(f"fio failed ({done.returncode}): {done.stderr.strip()[:400]}")
    report = json.loads(done.stdout[done.stdout.index("{") :])
    return report["jobs"][0][case.op]["bw_bytes"] / GB


# ---- output ----


class Progress:
    """Case-by-case progress on stderr.

    On a terminal, one bar redrawn in place. Anywhere else (a log file, a pipe, CI) carriage-return redraws
    pile up as clutter, so it writes one line per finished case instead.
    """

    width = 24

    def __init__(self, total: int, stream=None) -> None:
        self.total = total
        self.stream = stream if stream is not None else sys.stderr
        self.tty = _isatty(self.stream)
        self._line_open = False  # a bar is drawn and its line not yet ended

    def start(self, index: int, case: Case) -> None:
        if self.tty:
            self._draw(index, case.label())

    def finish(self, index: int, row: Row) -> None:
        if self.tty:
            if index + 1 == self.total:
                self._draw(self.total, "done")
                self.close()
        else:
            self.stream.write(f"[{index + 1}/{self.total}] {row.case.label()}: {row.median:.2f} GB/s median\n")
            self.stream.flush()

    def close(self) -> None:
        """Ends a half-drawn bar's line, so what is printed next starts on its own line."""
        if self._line_open:
            self.stream.write("\n")
            self.stream.flush()
            self._line_open = False

    def _draw(self, done: int, label: str) -> None:
        filled = self.width * done // max(self.total, 1)
        self.stream.write(f"\r[{'#' * filled}{'.' * (self.width - filled)}] {done}/{self.total} {label:<44}")
        self.stream.flush()
        self._line_open = True


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def format_table(rows: list[Row]) -> str:
    with_fio = any(row.fio for row in rows)
    head = f"{'setting':<40} {'median':>7} {'min':>7} {'max':>7}"
    if with_fio:
        head += f" {'fio':>7} {'fio-huge':>8} {'ratio':>6}"
    lines = ["throughput in GB/s (1 GB = 1e9 bytes)", head, "-" * len(head)]
    for row in rows:
        line = f"{row.case.label():<40} {row.median:7.2f} {min(row.gbps):7.2f} {max(row.gbps):7.2f}"
        if with_fio:
            fio_default, fio_huge = row.fio.get("malloc"), row.fio.get("shmhuge")
            line += f" {_num(fio_default):>7} {_num(fio_huge):>8} {_num(row.ratio):>6}"
        lines.append(line)
    return "\n".join(lines)


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def write_cache_note(rows: list[Row]) -> str | None:
    """A line explaining writes measured faster than reads, only when they are (it would be noise otherwise)."""
    reads = [row.median for row in rows if row.case.op == "read"]
    writes = [row.median for row in rows if row.case.op == "write"]
    if not reads or not writes or max(writes) <= max(reads):
        return None
    return (
        f"writes measured faster than reads ({max(writes):.2f} vs {max(reads):.2f} GB/s, best of each): the "
        "device's write cache acknowledges writes before they reach the media, so write figures can exceed "
        "what the device sustains; reads are the honest figure"
    )


def best_settings(rows: list[Row]) -> tuple[Row | None, Row | None, dict]:
    """Best read row, best write row, and the aio block maximising read + write medians."""
    reads = [r for r in rows if r.case.op == "read"]
    writes = [r for r in rows if r.case.op == "write"]
    best_read = max(reads, key=lambda r: r.median, default=None)
    best_write = max(writes, key=lambda r: r.median, default=None)
    totals: dict[tuple, float] = {}
    for row in rows:
        key = tuple(sorted(row.case.aio_block().items()))
        totals[key] = totals.get(key, 0.0) + row.median
    best_block = dict(max(totals, key=totals.get)) if totals else {}
    return best_read, best_write, best_block


def write_plot(rows: list[Row], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [row.case.label() for row in rows]
    x = range(len(rows))
    width = 0.28
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(rows) + 2), 4.5))
    ours = [row.median for row in rows]
    errors = [[row.median - min(row.gbps) for row in rows], [max(row.gbps) - row.median for row in rows]]
    ax.bar([i - width for i in x], ours, width, yerr=errors, label="infinity (median, min-max)")
    if any(row.fio for row in rows):
        ax.bar(list(x), [row.fio.get("shmhuge") or 0 for row in rows], width, label="fio, huge-page buffers")
        ax.bar([i + width for i in x], [row.fio.get("malloc") or 0 for row in rows], width, label="fio, default")
    ax.set_xticks(list(x))
    ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("GB/s (1e9 bytes/s)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def environment() -> dict:
    import torch

    return {
        "kernel": platform.release(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "engine_backend": core.BACKEND,
        "fio": _fio_version(),
    }


def _fio_version() -> str | None:
    if not shutil.which("fio"):
        return None
    done = subprocess.run(["fio", "--version"], capture_output=True, text=True, check=False)
    return done.stdout.strip() or None


# ---- main ----


def run(args: argparse.Namespace, out=None) -> dict:
    """Measures every case and prints the table; on Ctrl-C or SIGTERM, the rows measured so far.

    The result has ``interrupted`` set when the sweep was cut short (main then exits 130).
    """
    out = out or sys.stdout
    check_output_path("--json", args.json_path)
    check_output_path("--plot", args.plot_path, needs_matplotlib=True)
    folder_parent = args.folder or os.getcwd()
    check_folder(folder_parent, args.io_size)
    cases = expand_cases(args)
    workdir = tempfile.mkdtemp(prefix="infinity-aio-bench-", dir=folder_parent)
    path = os.path.join(workdir, "bench.bin")
    location = describe_location(workdir)
    measured = os.path.realpath(folder_parent)
    if not location["direct_io"] and not args.buffered:
        shutil.rmtree(workdir, ignore_errors=True)
        raise BenchError(f"{measured} refuses O_DIRECT ({location['filesystem']}); use --buffered")
    use_fio = args.vs_fio and shutil.which("fio") is not None and not args.buffered
    if args.vs_fio and not use_fio:
        reason = "fio is not on PATH (Debian package: fio)" if not shutil.which("fio") else "--buffered runs"
        print(f"note: --vs-fio skipped: {reason}; carrying on without it", file=out)
    buffer_bytes = min(args.buffer_size or args.io_size, args.io_size)  # as Engine sizes it
    engine = None
    rows: list[Row] = []
    interrupted = False
    progress = Progress(len(cases))
    try:
        engine = Engine(path, args.io_size, buffer_bytes)
        if "read" in args.ops:
            engine.prepare_file()
        with HugePageReservation(fio_pages_needed(cases) if use_fio else 0) as huge:
            for index, case in enumerate(cases):
                progress.start(index, case)
                for _ in range(max(args.warmup, 0)):
                    engine.run(case)
                row = Row(case, [engine.run(case) for _ in range(args.loops)])
                if use_fio:
                    for iomem in ("malloc", "shmhuge"):
                        if iomem == "shmhuge" and not huge.available:
                            row.fio_notes.append(huge.note)
                            continue
                        row.fio[iomem] = statistics.median(
                            run_fio(path, case, args.io_size, iomem) for _ in range(args.loops)
                        )
                rows.append(row)
                progress.finish(index, row)
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM through main's handler: report what was measured
        interrupted = True
    finally:
        progress.close()
        if engine is not None:
            engine.close()
        shutil.rmtree(workdir, ignore_errors=True)

    print(
        f"measured {measured} ({location['filesystem']} on {location['device']}, mounted at "
        f"{location['mount_point']}), O_DIRECT {'works' if location['direct_io'] else 'refused'}",
        file=out,
    )
    print(
        f"io-size {format_size(args.io_size)}, host buffer {format_size(buffer_bytes)}, "
        f"{args.loops} timed loops after {args.warmup} warm-up",
        file=out,
    )
    if interrupted:
        print(
            f"INTERRUPTED after {len(rows)} of {len(cases)} settings: the rows below are those measured so far; "
            "the test file was removed",
            file=out,
        )
    print(format_table(rows), file=out)
    notes = sorted({n for row in rows for n in row.fio_notes})
    cache_note = write_cache_note(rows)
    if cache_note:
        notes.append(cache_note)
    for note in notes:
        print(f"note: {note}", file=out)
    result = {
        "tool": "infinity aio-bench",
        "units": "GB/s, 1 GB = 1e9 bytes",
        "measured_folder": measured,
        "io_size": args.io_size,
        "buffer_bytes": buffer_bytes,
        "loops": args.loops,
        "warmup": args.warmup,
        "location": location,
        "environment": environment(),
        "interrupted": interrupted,
        "cases_total": len(cases),
        "notes": notes,
        "rows": [row.as_json() for row in rows],
    }
    if args.tune and interrupted:
        print("--tune: the sweep was interrupted, so no aio block is suggested; run it again to the end", file=out)
    elif args.tune:
        best_read, best_write, block = best_settings(rows)
        if best_read:
            print(f"best read:  {best_read.case.label()}  {best_read.median:.2f} GB/s", file=out)
        if best_write:
            print(f"best write: {best_write.case.label()}  {best_write.median:.2f} GB/s", file=out)
        print("paste into your config (maximises read + write):", file=out)
        print('"aio": ' + json.dumps(block, indent=2), file=out)
        result["tune"] = {"aio": block}
    if args.json_path:
        try:
            with open(args.json_path, "w") as f:
                json.dump(result, f, indent=2)
        except OSError as e:  # checked up front, so this is a change since (a full disk, a removed folder)
            raise BenchError(
                f"--json {args.json_path!r}: cannot write ({e.strerror}); the table above has the results"
            ) from None
    if args.plot_path and rows:
        try:
            write_plot(
                rows,
                args.plot_path,
                f"infinity aio-bench, io-size {format_size(args.io_size)}, "
                f"{location['filesystem']} on {location['device']}{', interrupted' if interrupted else ''}",
            )
        except OSError as e:
            raise BenchError(
                f"--plot {args.plot_path!r}: cannot write ({e.strerror}); the table above has the results"
            ) from None
    return result


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.warmup < 0:
        parser.error(f"argument --warmup: must be >= 0, got {args.warmup}")
    if args.buffered and args.buffer_size and args.buffer_size < args.io_size:
        parser.error("--buffer-size smaller than --io-size streams through a ring with direct I/O; drop --buffered")
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        result = run(args)
    except (BenchError, ConfigError) as e:
        parser.exit(2, f"infinity aio-bench: error: {e}\n")
    except KeyboardInterrupt:  # outside the measuring (setup, or while printing): nothing partial to show
        print("\ninterrupted; the test file was removed", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 130 if result["interrupted"] else 0


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
