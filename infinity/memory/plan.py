"""One plan of a run's sizes, computed once at initialize() from the config, the layout's sizes and the node, and
read by everything that sizes a buffer or places a piece: the engine, the tier managers' owners (zero/shards.py,
the optimizer's tiles) and `infinity estimate` (budget.py). Nothing else decides these numbers.

[Note: one plan]
A size two ranks decide each on their own is a size they may disagree on. At stages 1-2 the optimizer's tiles
are all-gathered tile by tile, so every rank must cut its piece of a bucket at the same offsets: a rank that sized
its tiles from its own MemAvailable would gather another size than its peers (a gloo error, a hang, or with NCCL
weights landing in the wrong place). And every rank that sizes its host buffers from the node's free memory asks
for all of it: eight ranks on a node asked for twice its RAM. So the sizes come from facts every rank shares:
- the config (sub_group_size, the offload sections' buffer counts and sizes, max_in_cpu, allgather_bucket_size);
- the layout's sizes (the units' pieces, the optimizer's runs), numbers only: the same on every rank;
- the node, surveyed once by ``survey`` (one all-gather over the engine's group at initialize): each rank's host
  name, its host's available memory and the free space under each nvme_path. Every rank computes the plan from
  the same gathered facts, so the numbers agree with no further collective.
A rank's host share is the smallest, over the ranks, of its host's available memory divided by the ranks on that
host: the minimum makes every rank agree, the division makes the ranks of a node share it. Of the share, a quarter
holds the parameter pieces max_in_cpu keeps in host memory, another the reduced fp32 gradient at stage 3 with the
optimizer on NVMe (``gradients_on_nvme``: when it does not fit there it goes to NVMe with the tiles), and at most a
sixteenth (and STAGING_BUDGET_BYTES) each of the NVMe staging rings (the parameters', the optimizer's with its
gradients', which at stage 3 may take up to LEAD_RING_BYTES to hold the largest unit's tiles: [Note: the lead
unit's ring]) and of the outsized pieces kept from the step to the next forward, and of a checkpoint's transfers in
flight (save_checkpoint and load_checkpoint only, at most CHECKPOINT_IO_BYTES): three quarters of the share at most,
the rest is left to activations, gathered units, gradient buckets and the runtime. On a node with 4 GiB or more per
rank the rings keep their full budget (8 GiB for stage 3's optimizer ring to reach LEAD_RING_BYTES); on a very
small share the optimizer's ring still holds tiles of MIN_TILE_NUMEL elements. At stages 1-2 a tile's new weights
travel in gathers of at most allgather_bucket_size elements (all ranks' parts together).

NVMe: the plan adds up every swap file's segments (each 4 KiB-aligned, as the store lays them out) for each
rank, and ``check_room`` sets the ranks of each host against the free space of each filesystem before any
store is opened: a run the disk cannot hold fails in one line, with the total and the free space, before a byte
is written (`infinity train` checks zero.Init's copy, which initialize() gives back piece by piece as its own
files fill, and the checkpoints before it builds anything). zero.Init
alone cannot know the model's size; it checks piece by piece and stops before the disk has less than
INIT_DISK_RESERVE of its size free (``check_init_piece``).
"""

from __future__ import annotations

import math
import os
import socket
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch.distributed as dist

from infinity.aio import buffers
from infinity.config import ZeroConfig
from infinity.errors import CollectiveError, ConfigError, TierBudgetError
from infinity.memory.nvme_store import _human

if TYPE_CHECKING:
    from infinity.comm import Comm

STAGING_BUDGET_BYTES = 256 << 20  # the most one staging ring (or the outsized pieces' cache) holds per rank
LEAD_RING_BYTES = 512 << 20  # stage 3: the optimizer's ring may grow to this to hold the largest unit's tiles
MIN_TILE_NUMEL = 1 << 20  # a smaller tile is too small a request to keep the disk busy
MAX_TILE_GATHERS = 2  # stages 1-2: gathers of new weights in flight at once (zero/bucket_optimizer.py)
TILE_MULTIPLE = 64  # tiles are cut at multiples of 64 elements (zero/tiles.py, cut: SIMD lanes)
NVME_ALIGN = 4096  # each segment of a swap file starts on a 4 KiB boundary (nvme_store.py)
HOST_CACHE_PART = 4  # max_in_cpu's pieces: a quarter of the rank's host share
GRADIENT_PART = 4  # stage 3, optimizer on NVMe: the reduced fp32 gradient stays in host memory within a quarter
STAGING_PART = 16  # each staging ring, the outsized pieces' cache and a checkpoint's I/O: a sixteenth of it
CHECKPOINT_IO_BYTES = 512 << 20  # the most a save or load has queued to the disk per rank
INIT_DISK_RESERVE = 0.10  # zero.Init, which cannot know the model's size, never leaves less free than this
HOST_MEMORY_ENV = "INFINITY_HOST_MEMORY_BYTES"  # plan with at most this much of the node's memory


COMPACT_TILE_SLACK = 32  # bytes: a compact tile's partial last blocks' scales and padding (7 per state, 3 at most)


def round_up(nbytes: int, align: int = NVME_ALIGN) -> int:
    return -(-nbytes // align) * align


# ---- the node ----
def host_memory_bytes() -> int:
    """The node's host memory a run may plan with: what can be allocated without swapping (aio/buffers.py), at
    most INFINITY_HOST_MEMORY_BYTES when set (a node shared with other jobs)."""
    available = buffers.available_host_bytes()
    limit = os.environ.get(HOST_MEMORY_ENV)
    if limit is None or not limit.strip():
        return available
    try:
        value = int(limit)
    except ValueError:
        value = -1
    if value < 1:
        raise ConfigError(f"{HOST_MEMORY_ENV}={limit!r}: give a number of bytes (at least 1), or unset it")
    return min(available, value)


@dataclass(frozen=True, slots=True)
class Disk:
    """The filesystem holding an nvme_path, as one rank sees it."""

    path: str
    device: int  # st_dev: the paths of one host on one filesystem share its free space
    free: int  # bytes an unprivileged writer may still use
    size: int


def disk_space(path: str) -> Disk | None:
    """The filesystem of ``path``; None when it does not exist (the swap store's own checks say what is wrong)."""
    try:
        vfs = os.statvfs(path)
        device = os.stat(path).st_dev
    except OSError:
        return None
    return Disk(os.path.abspath(path), device, vfs.f_bavail * vfs.f_frsize, vfs.f_blocks * vfs.f_frsize)


@dataclass(frozen=True, slots=True)
class RankFacts:
    host: str
    host_bytes: int  # its host's memory to plan with (host_memory_bytes)
    disks: tuple[Disk | None, ...]  # per nvme path of the survey, in its order


@dataclass(frozen=True, kw_only=True, slots=True)
class Node:
    """What every rank found about its machine at initialize, the same on every rank."""

    rank: int
    ranks: tuple[RankFacts, ...]
    paths: tuple[str, ...]  # the nvme paths surveyed

    def ranks_on(self, host: str) -> int:
        return sum(facts.host == host for facts in self.ranks)

    @property
    def local_ranks(self) -> int:
        """Ranks on a host: the most on any one (all ranks of a single-node run), the same on every rank."""
        return max(self.ranks_on(facts.host) for facts in self.ranks)

    @property
    def host_share(self) -> int:
        """Bytes of host memory each rank plans with: the smallest over the ranks of its host's memory divided
        by the ranks on that host ([Note: one plan])."""
        return min(facts.host_bytes // self.ranks_on(facts.host) for facts in self.ranks)


def _facts(paths: Sequence[str]) -> RankFacts:
    return RankFacts(socket.gethostname(), host_memory_bytes(), tuple(disk_space(path) for path in paths))


def survey(comm: Comm, paths: Sequence[str]) -> Node:
    """Collective (one all-gather over the engine's group): every rank's host, memory and disks."""
    paths = tuple(paths)
    mine = _facts(paths)
    if not comm.active:
        return Node(rank=0, ranks=(mine,), paths=paths)
    gathered: list[RankFacts | None] = [None] * comm.world_size
    try:
        dist.all_gather_object(gathered, mine, group=comm.group)
    except RuntimeError as e:  # torch.distributed's errors (DistBackendError, gloo's) are RuntimeErrors
        raise CollectiveError(op="all-gather (the plan's survey of the node)", group=comm.name,
                              timeout_s=comm.timeout_s, cause=str(e)) from e  # fmt: skip
    return Node(rank=comm.rank, ranks=tuple(gathered), paths=paths)


def this_machine(paths: Sequence[str], *, ranks: int) -> Node:
    """The node as ``ranks`` ranks on this machine would find it (for `infinity estimate`, before any run)."""
    mine = _facts(tuple(paths))
    return Node(rank=0, ranks=(mine,) * ranks, paths=tuple(paths))


def nvme_paths(zero: ZeroConfig) -> tuple[str, ...]:
    """The offload sections' nvme_paths that hold swap files (parameters first), each once."""
    found = []
    for spec in (zero.offload_param, zero.offload_optimizer):
        if spec.device == "nvme" and spec.nvme_path and spec.nvme_path not in found:
            found.append(spec.nvme_path)
    return tuple(found)


# ---- the sizes ----
@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    """Every size two ranks must agree on, and each rank's share of the node's host memory ([Note: one plan])."""

    world_size: int
    local_ranks: int  # ranks on a host (the most crowded one): what the host share was divided by, at most
    host_share: int  # bytes of host memory this rank plans with
    host_cache_bytes: int  # parameter pieces kept in host memory (max_in_cpu), at most
    staging_bytes: int  # each NVMe staging ring (stage 3's optimizer ring: LEAD_RING_BYTES), the outsized pieces kept
    # behind the step, at most
    tile_numel: int  # elements per optimizer tile (a multiple of TILE_MULTIPLE): every rank cuts the same tiles
    gather_numel: int  # stages 1-2: elements per rank in one all-gather of new weights (allgather_bucket_size)
    optimizer_buffers: int  # the optimizer's NVMe ring (and its gradients')
    gradients_on_nvme: bool  # stage 3, optimizer on NVMe: the reduced gradient too (it did not fit GRADIENT_PART)
    gradient_itemsize: int  # bytes per element of the gradient on NVMe (infinity.offloaded_gradient_dtype)
    param_buffers: int  # the parameters' NVMe ring
    checkpoint_io_bytes: int  # a save's or load's transfers in flight, at most (checkpoint/chunk_io.py)

    def host_cache_numel(self, zero: ZeroConfig, itemsize: int) -> int:
        """Elements of parameter pieces kept in host memory in front of NVMe: max_in_cpu, within the share."""
        return min(zero.offload_param.max_in_cpu, self.host_cache_bytes // itemsize)


def make_plan(zero: ZeroConfig, *, world_size: int, local_ranks: int, host_share: int, state_width: float,
              gradient_bytes: int = 0, gradient_itemsize: int = 4, largest_unit_numel: int = 0) -> Plan:  # fmt: skip
    """The sizes of a run. ``state_width``: fp32 tensors per element of an optimizer tile (master + optimizer
    states; fractional where the states are compact, [Note: compact states] in zero/compact.py); 0 without
    optimizer. ``gradient_bytes``: the rank's reduced fp32 gradient (stage 3), which stays in
    host memory when a quarter of the share holds it, as at stages 1-2, and goes to NVMe with the optimizer
    otherwise (its ring is as deep as the tiles'). In memory it moves no bytes through the disk: on NVMe it is
    written by backward and read by the step, 8 of the ~36 bytes a parameter moves per step (4 where
    ``gradient_itemsize`` is 2: stored in bf16). ``largest_unit_numel``: stage 3, the rank's largest unit piece
    ([Note: the lead unit's ring])."""
    staging = min(STAGING_BUDGET_BYTES, host_share // STAGING_PART)
    optimizer_buffers = max(zero.offload_optimizer.buffer_count, 3)  # one stepping, one reading, one writing
    on_nvme = zero.offload_optimizer.device == "nvme" and state_width > 0
    gradients_on_nvme = on_nvme and zero.stage == 3 and gradient_bytes > host_share // GRADIENT_PART
    tile = zero.sub_group_size
    if on_nvme:
        width = state_width + gradients_on_nvme * gradient_itemsize / 4
        cap = max(int(staging // (optimizer_buffers * width * 4)), MIN_TILE_NUMEL)
        tile = min(tile, cap)
    tile = max(tile // TILE_MULTIPLE * TILE_MULTIPLE, TILE_MULTIPLE)
    if on_nvme and zero.stage == 3 and largest_unit_numel and tile >= MIN_TILE_NUMEL:
        optimizer_buffers = max(optimizer_buffers, lead_ring_buffers(largest_unit_numel, tile, width, host_share))
    return Plan(
        world_size=world_size, local_ranks=local_ranks, host_share=host_share,
        host_cache_bytes=host_share // HOST_CACHE_PART, staging_bytes=staging, tile_numel=tile,
        gather_numel=max(zero.allgather_bucket_size // world_size, 1), optimizer_buffers=optimizer_buffers,
        gradients_on_nvme=gradients_on_nvme, gradient_itemsize=gradient_itemsize,
        param_buffers=max(zero.offload_param.buffer_count, 1),
        checkpoint_io_bytes=min(CHECKPOINT_IO_BYTES, host_share // STAGING_PART),
    )  # fmt: skip


def lead_ring_buffers(unit_numel: int, tile_numel: int, width: float, host_share: int) -> int:
    """[Note: the lead unit's ring]
    At stage 3 with the optimizer on NVMe the step's first tiles are read during backward, as far as the ring
    goes, and the rest when the next forward first uses their unit. The first unit is usually the largest (the
    embedding, GPT-2's tied to its head: 38.6M elements, 463 MB of master and Adam states at world size 1), and the
    forward's first operation waits for all of it: with 4 buffers of 64 MiB, 3 of its 7 tiles were read in the
    forward, each behind the writes of the tiles before (150-190 ms a step). So the ring takes as many buffers as
    the largest unit piece has tiles, and one for the small pieces before it, within LEAD_RING_BYTES and the
    share's sixteenth; offload_optimizer.buffer_count stays the least. The tile size does not change, so neither
    do the tiles or their results. Only tiles of MIN_TILE_NUMEL and more (each buffer is mapped in whole huge
    pages): a smaller sub_group_size keeps the ring buffer_count deep, as asked."""
    buffer_bytes = round_up(max(int(tile_numel * width * 4), 1), buffers.HUGE_PAGE_BYTES)
    room = min(LEAD_RING_BYTES, host_share // STAGING_PART) // buffer_bytes
    return min(-(-unit_numel // tile_numel) + 1, room)


def host_kept(pieces: Iterable[tuple[int, int]], cap: int) -> set[int]:
    """The units whose pieces stay in host memory (offload_param.max_in_cpu): ``pieces`` are (unit, elements) in
    the units' order; each piece is kept when the running total of kept elements stays within ``cap``, so a
    piece too large to fit is skipped and later, smaller ones may still be kept ([Note: unit shards] in
    zero/shards.py)."""
    kept: set[int] = set()
    total = 0
    for index, numel in pieces:
        if cap > 0 and total + numel <= cap:
            kept.add(index)
            total += numel
    return kept


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a rank's stage-3 parameter pieces live with offload_param on NVMe ([Note: unit shards])."""

    kept: frozenset[int]  # units whose pieces stay in host memory (max_in_cpu)
    on_nvme: tuple[int, ...]  # the others, in the units' order
    buffer_bytes: int  # each staging ring buffer: the largest NVMe piece within the budget (none fits: the cap)


def place_parameters(pieces: Sequence[tuple[int, int]], *, itemsize: int, host_numel: int, staging_bytes: int,
                     buffer_count: int, max_piece_numel: int | None) -> Placement:  # fmt: skip
    """``pieces``: (unit, elements) of the movable units in order. The ring's buffers fit the largest NVMe piece
    within ``staging_bytes`` / ``buffer_count`` (offload_param.buffer_size caps it too): a few outsized pieces
    are read on demand rather than making every buffer their size."""
    kept = frozenset(host_kept(pieces, host_numel))
    on_nvme = tuple(index for index, _ in pieces if index not in kept)
    numel = dict(pieces)
    cap = staging_bytes // max(buffer_count, 1)
    if max_piece_numel is not None:
        cap = min(cap, max_piece_numel * itemsize)
    fitting = [numel[index] * itemsize for index in on_nvme if numel[index] * itemsize <= cap]
    return Placement(kept, on_nvme, max(fitting, default=cap) if on_nvme else 0)


def outsized_kept(nbytes: Iterable[int], budget: int) -> int:
    """Bytes of outsized pieces the step keeps for the next forward: whole pieces, in order, within ``budget``
    (zero/shards.py keeps the first ones the step commits while they fit)."""
    total = 0
    for size in nbytes:
        if total + size <= budget:
            total += size
    return total


def outsized_spare_bytes(nbytes: Sequence[int], fresh_budget: int) -> int:
    """Bytes of outsized pieces' buffers kept between steps for reuse (zero/shards.py): the one the step edits
    (the largest) and those the fresh cache holds (``outsized_kept``), which come back once the next forward has
    read them. A piece whose buffer is still being written when the next edit comes takes a new one."""
    return (max(nbytes) + outsized_kept(nbytes, fresh_budget)) if nbytes else 0


def tile_numels(runs: Iterable[int], tile_numel: int) -> list[int]:
    """The tiles' sizes, as zero/tiles.py cuts each run (``tile_numel`` is already a multiple of TILE_MULTIPLE)."""
    sizes = []
    for run in runs:
        full, rest = divmod(run, tile_numel)
        sizes += [tile_numel] * full + ([rest] if rest else [])
    return sizes


# ---- NVMe ----
@dataclass(frozen=True, kw_only=True, slots=True)
class LayoutSizes:
    """What the plan needs of the model's partition, elements per rank, as the engine lays it out."""

    units: tuple[tuple[int, int], ...] = ()  # stage 3: (unit, piece) of every unit that is not persistent
    runs: tuple[int, ...] = ()  # the optimizer's runs of elements (bucket pieces; stage 3: unit pieces)
    more_runs: int = 0  # at most this many more runs, where param groups or frozen parameters cut a unit's piece
    init_pieces: tuple[int, ...] = ()  # zero.Init's piece of each parameter (for `infinity train`)


@dataclass(frozen=True, kw_only=True, slots=True)
class SwapNeed:
    """Bytes of one rank's swap files, by nvme_path."""

    parameters: int = 0
    optimizer: int = 0
    gradients: int = 0
    init: int = 0  # zero.Init's pieces, on the disk until initialize() takes them (each given back as taken)
    param_path: str | None = None
    optimizer_path: str | None = None

    def by_path(self, *, with_init: bool = False, init_given_back: bool = True) -> dict[str, int]:
        """Bytes per path at the peak. ``with_init``: from before zero.Init builds the model; its pieces (under
        the parameters' path) are given back one by one as initialize() fills the run's files there, which it
        opens sparse ([Note: deferred reservation] in nvme_store.py): the peak is the larger of the two; where
        the filesystem cannot punch holes (``init_given_back`` False) the copy stays: their sum."""
        need: dict[str, int] = {}
        for path, nbytes in ((self.param_path, self.parameters),
                             (self.optimizer_path, self.optimizer + self.gradients)):  # fmt: skip
            if path is not None and nbytes:
                need[path] = need.get(path, 0) + nbytes
        if with_init and self.init and self.param_path is not None:
            held = need.get(self.param_path, 0)
            need[self.param_path] = max(held, self.init) if init_given_back else held + self.init
        return need

    def describe(self, *, with_init: bool = False) -> str:
        parts = [(what, n) for what, n in (("parameters", self.parameters), ("optimizer", self.optimizer),
                                           ("gradients", self.gradients)) if n]  # fmt: skip
        if with_init and self.init:
            parts.append(("zero.Init's copy (given back as initialize() takes it)", self.init))
        return ", ".join(f"{what} {_human(n)}" for what, n in parts)


def swap_need(plan: Plan, zero: ZeroConfig, layout: LayoutSizes, *, state_width: float,
              param_itemsize: int) -> SwapNeed:  # fmt: skip
    """Every segment of the rank's swap files, 4 KiB-aligned as the store lays them out: parameter pieces not kept
    in host memory, the optimizer's tiles [master | states] (``state_width`` fp32 each) and the gradient's where the
    plan put it on NVMe. ``more_runs`` adds at most one segment each (a run cut in two has one more partial
    tile)."""
    param, opt = zero.offload_param, zero.offload_optimizer
    parameters = init = 0
    if param.device == "nvme":
        placement = place_parameters(layout.units, itemsize=param_itemsize, staging_bytes=plan.staging_bytes,
                                     host_numel=plan.host_cache_numel(zero, param_itemsize),
                                     buffer_count=plan.param_buffers, max_piece_numel=param.buffer_size)  # fmt: skip
        numel = dict(layout.units)
        parameters = sum(round_up(numel[index] * param_itemsize) for index in placement.on_nvme)
        init = sum(round_up(piece * 4) for piece in layout.init_pieces)  # built in fp32
    optimizer = gradients = 0
    if opt.device == "nvme":
        tiles = tile_numels(layout.runs, plan.tile_numel)
        # + COMPACT_TILE_SLACK: a compact tile's partial last block has a scale of its own ([Note: compact states])
        optimizer = sum(round_up(math.ceil(n * state_width * 4) + COMPACT_TILE_SLACK * (state_width % 1 > 0))
                        for n in tiles) + layout.more_runs * NVME_ALIGN  # fmt: skip
        if plan.gradients_on_nvme:
            gradients = sum(round_up(n * plan.gradient_itemsize) for n in tiles) + layout.more_runs * NVME_ALIGN
    return SwapNeed(parameters=parameters, optimizer=optimizer, gradients=gradients, init=init,
                    param_path=param.nvme_path if param.device == "nvme" else None,
                    optimizer_path=opt.nvme_path if opt.device == "nvme" else None)  # fmt: skip


NVME_ADVICE = "free space there, set nvme_path to a larger disk, or offload less to NVMe"


def check_room(node: Node, per_rank: dict[str, int], *, what: str, detail: str,
               shared: dict[str, tuple[int, str]] | None = None, advice: str = NVME_ADVICE) -> None:  # fmt: skip
    """Each host's ranks against the free space of each filesystem they write to, before anything is written.
    ``per_rank``: bytes each rank writes under each path (the same on every rank: the layout's sizes are);
    ``shared``: bytes written once per host under a path, and what they are (checkpoints). Every rank decides
    from the same survey, so a run that does not fit fails on every rank with the same one line."""
    demand: dict[tuple[str, int], dict] = {}  # (host, filesystem) -> what goes there
    for rank, facts in enumerate(node.ranks):
        for path in [*per_rank, *(shared or {})]:
            disk = facts.disks[node.paths.index(path)] if path in node.paths else None
            if disk is None:
                continue  # not there: the store's own checks name the path
            fresh = {"ranks": set(), "free": disk.free, "path": disk.path, "paths": set()}
            entry = demand.setdefault((facts.host, disk.device), fresh)
            entry["ranks"].add(rank)
            entry["paths"].add(path)
            entry["free"] = min(entry["free"], disk.free)
    hosts = {facts.host for facts in node.ranks}
    for (host, _), entry in sorted(demand.items(), key=lambda item: item[0]):
        each = sum(per_rank.get(path, 0) for path in entry["paths"])
        once = [shared[path] for path in sorted(entry["paths"]) if shared and path in shared]
        total = each * len(entry["ranks"]) + sum(nbytes for nbytes, _ in once)
        if total <= entry["free"]:
            continue
        where = f"{entry['path']!r}" + (f" on {host}" if len(hosts) > 1 else "")
        parts = [f"{len(entry['ranks'])} rank(s) x {_human(each)}: {detail}"] if each else []
        parts += [f"{label}: {_human(nbytes)}" for nbytes, label in once]
        raise TierBudgetError(
            f"{what} needs {_human(total)} on {where} ({'; '.join(parts)}) but it has {_human(entry['free'])} free: "
            f"{advice}"
        )


def check_init_piece(path: str, nbytes: int) -> None:
    """zero.Init, before writing a piece: the disk keeps at least INIT_DISK_RESERVE of its size free. It cannot
    know the model's size (`infinity train` and initialize() check a run's whole need), so it stops before it
    fills the disk rather than when it has."""
    disk = disk_space(path)
    if disk is None:
        return
    floor = int(disk.size * INIT_DISK_RESERVE)
    if disk.free - nbytes < floor:
        left = _human(max(disk.free - nbytes, 0))
        raise TierBudgetError(
            f"zero.Init: the next piece ({_human(nbytes)}) would leave {path!r} with {left} "
            f"free, under {INIT_DISK_RESERVE:.0%} of its {_human(disk.size)}: free space there or set "
            "offload_param.nvme_path to a larger disk"
        )
