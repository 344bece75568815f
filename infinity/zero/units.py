"""Units: the grain of ZeRO-3. Each module's own parameters flattened into one buffer, sharded across ranks.

[Note: units]
Every module that directly owns parameters gets one unit: its parameters laid out in order in one flat buffer,
padded to world_size * ALIGN and split equally; rank r keeps piece r (in ``UnitTable.shards``: device memory,
host memory or NVMe, [Note: unit shards] in shards.py). A parameter registered in several modules (tied
weights) belongs to the first owner in ``named_modules`` order; every module that uses it fetches that unit.
Parameters at or below the persistence threshold go to one persistent unit that is gathered once and never
released (DeepSpeed keeps such parameters whole on every rank); it is unit 0, so its gradient reduction is
launched last, when backward has produced all of them.

While a unit is gathered its parameters are views into ``Unit.full``; while released they are 0-element
placeholders (reading one is an empty tensor, never freed memory) and the storage of ``full`` is resized to
0 bytes. Re-gathering gives that same storage its bytes back, so views of a parameter that autograd saved in
forward see the gathered values again in backward (the technique of FSDP2); on the host the bytes come from
the table's StoragePool, already mapped ([Note: buffer reuse] in memory/pool.py).

[Note: no allocation per gather]
A gather and a release happen for every unit twice a step, amid the step's activations. Each used to make new
small objects that outlive the phase they are made in (a view per parameter, a 0-element placeholder per
parameter, a 0-byte storage for the pool's swap), which the C library places among the activations' blocks. The
views into ``full`` (valid for its whole life: its storage keeps its identity), the placeholders and the pool's
empty storages are made once and handed out again instead. (What grew stage 3's heap at a 32 MiB mmap
threshold was another leftover: [Note: multi-grad hooks] in stage3.py.)

The units double as the buckets of gradient reduction: ``layout`` is one GroupLayout whose buckets are the
units, in unit order, so GradientReducer reduce-scatters each unit's gradient into the rank's piece.
"""

from __future__ import annotations

import contextlib
import enum
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from infinity.memory.pool import StoragePool
from infinity.zero import collectives
from infinity.zero.collectives import Comm, Pending
from infinity.zero.partition import Bucket, GroupLayout, layout_from_runs
from infinity.zero.shards import UnitShards


class UnitState(enum.Enum):
    RELEASED = "released"
    IN_FLIGHT = "in flight"  # an asynchronous all-gather into ``full`` is running
    GATHERED = "gathered"


@dataclass(eq=False, slots=True)
class Unit:
    index: int
    name: str  # the owning module's path, or "<persistent>"
    params: list[nn.Parameter]
    shapes: list[torch.Size]
    bucket: Bucket
    persistent: bool
    full: torch.Tensor  # (padded_numel,) compute dtype; 0-byte storage while released
    pool: StoragePool  # where full's bytes come from and go back to (shared by the table's units)
    state: UnitState = UnitState.RELEASED
    pending: Pending | None = None
    staged_in: tuple | None = None  # (CopyStream, event): what attach() makes the compute stream wait for
    # Made once and handed out at every attach / release ([Note: no allocation per gather]): the parameters'
    # views into ``full``, and their 0-element placeholders while released.
    views: list[torch.Tensor] | None = None
    placeholders: list[torch.Tensor] | None = None

    @property
    def numel(self) -> int:
        return self.bucket.numel

    @property
    def padded_numel(self) -> int:
        return self.bucket.padded_numel

    def allocate(self) -> torch.Tensor:
        """Gives ``full`` its memory back (the same storage, so saved views stay valid)."""
        storage = self.full.untyped_storage()
        nbytes = self.full.numel() * self.full.element_size()
        if storage.nbytes() == 0:
            self.pool.fill(storage, nbytes)
        elif storage.nbytes() != nbytes:
            storage.resize_(nbytes)
        return self.full

    def attach(self) -> None:
        """Parameters become views into the gathered buffer."""
        if self.staged_in is not None:
            copies, event = self.staged_in
            copies.join(event, self.full)
            self.staged_in = None
        if self.views is None:
            self.views = [
                self.full[slot.offset : slot.offset + slot.numel].view(shape)
                for slot, shape in zip(self.bucket.slots, self.shapes, strict=True)
            ]
        for param, view in zip(self.params, self.views, strict=True):
            param.data = view
        self.state = UnitState.GATHERED

    def release(self) -> None:
        if self.placeholders is None:
            self.placeholders = [torch.empty(0, dtype=self.full.dtype, device=self.full.device) for _ in self.params]
        for param, placeholder in zip(self.params, self.placeholders, strict=True):
            param.data = placeholder
        self.pool.empty(self.full.untyped_storage())
        self.state = UnitState.RELEASED
        self.pending = None
        self.staged_in = None

    def gather(self, comm: Comm, shards: UnitShards, *, async_op: bool) -> Pending:
        """All-gather every rank's piece into ``full``; the parameters attach when it completes. A piece in host
        memory or on NVMe is staged in and gathered on the side stream where CUDA exists ([Note: copy stream])."""
        copies = shards.copies if shards.on_device(self.index) is None else None
        allocated = self.full.untyped_storage().nbytes() > 0  # e.g. the persistent unit, regathered each step
        with copies.side(after_compute=allocated) if copies is not None else contextlib.nullcontext():
            self.allocate()
            pending = gather_piece(comm, shards, self.index, self.bucket, self.full, async_op=async_op)
            event = copies.record() if copies is not None else None
        if event is not None:
            self.staged_in = (copies, event)
        if async_op:  # the request first: an interrupt between the two never leaves IN_FLIGHT without it
            self.pending = pending
            self.state = UnitState.IN_FLIGHT
        else:
            self.attach()
        return pending

    def wait(self) -> None:
        if self.state is UnitState.IN_FLIGHT:
            if self.pending is not None:  # None: waited for already, when an interrupt came before attach()
                self.pending.wait()
                self.pending = None
            self.attach()


def gather_piece(comm: Comm, shards: UnitShards, index: int, bucket: Bucket, out: torch.Tensor, *, async_op: bool):
    """out <- every rank's piece of the unit. A piece not on the device is first loaded into this rank's own slot of
    ``out``, which is then the all-gather's input (in place, as NCCL documents and gloo does). Under a caller's
    torch.inference_mode too, the views written here are ordinary tensors: the I/O threads (outside that mode)
    write into them, and a step run from here writes its buffers."""
    with torch.inference_mode(False):
        piece = shards.on_device(index)
        if piece is None:
            start, end = bucket.piece_range(comm.rank)
            piece = out[start:end]
            shards.load_into(index, piece)
        return collectives.all_gather_pieces(comm, out, piece, async_op=async_op)


@dataclass(slots=True)
class UnitTable:
    """All units of a model, which modules use which units, and the rank's flat shard they are views into."""

    units: list[Unit]
    modules: list[nn.Module]  # the root, then modules using a non-persistent unit, in named_modules order
    module_names: list[str]
    module_units: list[tuple[int, ...]]  # per entry of ``modules``: the non-persistent units it uses; grows
    # when a module's forward turns out to use another module's parameters (nn.MultiheadAttention reads
    # out_proj.weight without calling out_proj): see stage3.py
    layout: GroupLayout
    shards: UnitShards  # this rank's piece of every unit
    pool: StoragePool  # where the units' gathered bytes come from (each unit refers to it)
    param_unit: dict[int, tuple[int, int]] = field(default_factory=dict)  # id(param) -> (unit, position)

    def unit_of(self, param: nn.Parameter) -> tuple[Unit, int] | None:
        entry = self.param_unit.get(id(param))
        return None if entry is None else (self.units[entry[0]], entry[1])

    @property
    def largest_unit_numel(self) -> int:
        return max((u.numel for u in self.units if not u.persistent), default=0)

    def parameters(self) -> list[nn.Parameter]:
        return [p for unit in self.units for p in unit.params]


# The stage-3 runtime that owns each parameter (GatheredParameters looks it up), beside the parameters.
_RUNTIMES: WeakIdKeyDictionary = WeakIdKeyDictionary()


def register_runtime(params, runtime) -> None:
    """Weakly both ways: the runtime refers to its parameters, so a strong value would keep them (and the
    whole engine) alive forever."""
    reference = weakref.ref(runtime)
    for param in params:
        _RUNTIMES[param] = reference


def unregister_runtime(params) -> None:
    for param in params:
        _RUNTIMES.pop(param, None)


def stage3_runtime(param: nn.Parameter):
    reference = _RUNTIMES.get(param)
    return None if reference is None else reference()


def parameter_owners(model: nn.Module) -> list[tuple[str, nn.Module, list[nn.Parameter]]]:
    """(path, module, parameters it owns): each parameter once, at its first registration."""
    seen: set[int] = set()
    owners = []
    for path, module in model.named_modules():
        owned = []
        for param in module._parameters.values():
            if param is not None and id(param) not in seen:
                seen.add(id(param))
                owned.append(param)
        owners.append((path, module, owned))
    return owners


def build_units(
    model: nn.Module,
    *,
    comm: Comm,
    dtype: torch.dtype,
    device: torch.device,
    persistence_threshold: int,
    model_persistence_threshold: int,
    make_shards: Callable[[GroupLayout, set[int]], UnitShards],
) -> UnitTable:
    """Partitions ``model`` into units: the layout, the shard's home (``make_shards(layout, persistent units)``)
    and which modules use which units. No values move yet: the parameters keep theirs until ``fill_units``, so
    the optimizer's tiles can be made first and take their masters one unit at a time."""
    owners = parameter_owners(model)
    persistent: list[nn.Parameter] = []
    per_module: list[tuple[str, list[nn.Parameter]]] = []
    persistent_numel = 0
    for path, _, owned in owners:
        kept = []
        for param in owned:
            numel = _shape(param).numel()
            if numel <= persistence_threshold and persistent_numel + numel <= model_persistence_threshold:
                persistent.append(param)
                persistent_numel += numel
            else:
                kept.append(param)
        if kept:
            per_module.append((path or "<root>", kept))
    groups = [("<persistent>", persistent)] if persistent else []
    groups += per_module

    shapes = [[_shape(p) for p in params] for _, params in groups]
    numels, runs = [], []
    for group_shapes in shapes:
        runs.append(list(range(len(numels), len(numels) + len(group_shapes))))
        numels += [s.numel() for s in group_shapes]
    layout = layout_from_runs(0, numels, runs, world_size=comm.world_size)
    shards = make_shards(layout, {0} if persistent else set())
    units, param_unit = [], {}
    itemsize = torch.empty(0, dtype=dtype).element_size()
    pool = StoragePool(budget_bytes=sum(bucket.padded_numel for bucket in layout.buckets) * itemsize)
    for index, ((name, params), bucket) in enumerate(zip(groups, layout.buckets, strict=True)):
        full = torch.empty(bucket.padded_numel, dtype=dtype, device=device)
        full.untyped_storage().resize_(0)  # allocated while gathered only
        units.append(Unit(
            index=index, name=name, params=list(params), shapes=shapes[index], bucket=bucket,
            persistent=name == "<persistent>", full=full, pool=pool,
        ))  # fmt: skip
        for position, param in enumerate(params):
            param_unit[id(param)] = (index, position)

    modules, names, uses = [], [], []
    for path, module in model.named_modules():
        used = []
        for param in module._parameters.values():
            entry = None if param is None else param_unit.get(id(param))
            if entry is not None and not units[entry[0]].persistent and entry[0] not in used:
                used.append(entry[0])
        if used or module is model:  # the root is always entry 0: passes begin and end there
            modules.append(module)
            names.append(path or "<root>")
            uses.append(tuple(used))
    return UnitTable(
        units=units, modules=modules, module_names=names, module_units=uses, layout=layout,
        shards=shards, pool=pool, param_unit=param_unit,
    )  # fmt: skip


def fill_units(
    table: UnitTable,
    *,
    comm: Comm,
    full_value: Callable[[nn.Parameter], torch.Tensor],
    on_piece: Callable[[Unit, torch.Tensor], None] | None = None,
    after_unit: Callable[[], None] | None = None,
) -> None:
    """Moves the parameters' values into the units, one unit at a time: ``full_value(param)`` gives a parameter's
    whole value (zero.Init pieces are gathered), every rank takes rank 0's (as DeepSpeed broadcasts the model at
    start), the rank's piece goes to its home in the compute dtype and ``on_piece(unit, fp32 piece)`` (the
    optimizer's masters) sees it in fp32. So no more than one unit is ever whole here, and no whole fp32 shard is
    made anywhere. ``after_unit()``: called once a unit's whole values are freed."""
    for unit in table.units:
        bucket = unit.bucket
        wholes = (full_value(param) for param in unit.params)
        full = collectives.flat_from_rank0(comm, bucket, wholes, dtype=torch.float32, device=unit.full.device)
        start, end = bucket.piece_range(comm.rank)
        table.shards.store(unit.index, full[start:end].to(unit.full.dtype))
        if on_piece is not None:
            on_piece(unit, full[start:end])
        for param, shape in zip(unit.params, unit.shapes, strict=True):
            param.ds_shape = shape  # DeepSpeed's attribute names, read by some integrations
            param.ds_numel = shape.numel()
        if unit.persistent:
            unit.allocate().copy_(full)
            del full
            unit.attach()
        else:
            del full
            unit.release()
        if after_unit is not None:
            after_unit()


def _shape(param: nn.Parameter) -> torch.Size:
    """The logical shape: a zero.Init placeholder has 0 elements and carries its shape in ds_shape."""
    shape = getattr(param, "ds_shape", None)
    return torch.Size(shape) if shape is not None and param.numel() == 0 else param.shape
