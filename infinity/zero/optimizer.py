"""The partitioned optimizer for ZeRO stages 0-3 (optionally offloaded to host memory or NVMe).

Layout (see [Note: bucket-sharded layout] in partition.py): the model's trainable parameters become views into
flat per-bucket weight buffers in the compute dtype; each rank keeps fp32 masters of its pieces (stage 0: of
everything; in fp32 without offload the masters are those pieces of the weights themselves, one per bucket, with
no copy), the matching fp32 gradient shard while a window's gradients exist ([Note: gradient shards]), and the
optimizer states for exactly those elements. The user's torch optimizer is kept (so schedulers bound to it keep
working) and re-pointed at the masters, as DeepSpeed does. A step: unscale -> overflow check across ranks (fp16)
-> global-norm clipping -> the torch optimizer on the masters (tiles, with offload or at stage 3) -> new
low-precision pieces -> all-gather per bucket.
"""

from __future__ import annotations

import functools
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from infinity.errors import ConfigError
from infinity.memory.tiers import Tier, TierManager
from infinity.zero import collectives
from infinity.zero.collectives import Comm
from infinity.zero.gradient_shards import GradientShards, gradient_device
from infinity.zero.grads import SwappedGradients, piece_squares
from infinity.zero.partition import Bucket, GroupLayout, overlap, plan
from infinity.zero.reducer import GradientReducer
from infinity.zero.tiles import Tile, TiledStep, cut, rule_for
from infinity.zero.units import Unit, UnitTable
from infinity.zero.unused import reachable_leaves


@dataclass(frozen=True, slots=True)
class Offload:
    """Where the optimizer's masters and states live when offloaded ([Note: tiles] in tiles.py)."""

    manager: TierManager
    home: Tier  # HOST or NVME
    tile_numel: int  # the plan's: every rank cuts the same tiles ([Note: one plan] in memory/plan.py)
    pipeline_read: bool
    pipeline_write: bool
    gradients: TierManager | None = None  # stage 3 on NVMe: the gradient's tier ([Note: swapped gradients])
    gather_numel: int | None = None  # stages 1-2: elements per rank in one gather of new weights (None: a tile)


@dataclass(frozen=True, slots=True)
class StepResult:
    stepped: bool  # False when skipped for an fp16 overflow
    grad_norm: float  # global L2 norm of the (unscaled) gradient, before clipping


class PartitionedOptimizer:
    """The step shared by every stage: fp32 masters and the reduced gradient per param group, the user's optimizer
    re-pointed at the masters. Subclasses lay the shards out and publish the new weights."""

    optimizer: torch.optim.Optimizer
    comm: Comm
    stage: int
    device: torch.device
    masters: list[nn.Parameter]
    gradients_in_memory: GradientShards | None  # the reduced gradient ([Note: gradient shards]); None: on NVMe
    reducer: GradientReducer
    _hooks: list
    _no_grad_marks: dict[int, Callable[[], None]]  # id(param) -> what to do when it gets no gradient
    tiled: TiledStep | None = None  # offloaded: masters and states in tiles, no ``masters``
    masters_are_weights: bool = False  # stages 0-2 in fp32 without offload: each master is a piece of the weights

    def _make_tiled(self, optimizer: torch.optim.Optimizer, runs, offload: Offload, masters=None) -> TiledStep:
        # Before any work: an optimizer offload cannot run is a ConfigError.
        rule = rule_for(optimizer, in_memory=offload.home is Tier.DEVICE)
        tiled = TiledStep(
            tiles=cut(runs, offload.tile_numel), rule=rule, manager=offload.manager, home=offload.home,
            grads=self._tile_grad, weights=self._tile_weight, groups=len(optimizer.param_groups),
            pipeline_read=offload.pipeline_read,
            pipeline_write=offload.pipeline_write, masters=masters,
        )  # fmt: skip
        for group in optimizer.param_groups:
            group["params"] = []  # the masters live in the tiles; the groups keep the hyperparameters
        optimizer.state.clear()
        return tiled

    def _tiles_as_parameters(self) -> None:
        """A rule without its own update: the user's optimizer gets each tile's master as a parameter."""
        if self.tiled.rule.update is None:
            for tile, param in zip(self.tiled.tiles, self.tiled.as_parameters(), strict=True):
                self.optimizer.param_groups[tile.group]["params"].append(param)

    def prefetch_states(self) -> None:
        """At the end of the boundary's backward: start reading the first tiles of the step."""
        if self.tiled is not None:
            self.tiled.prefetch()

    # ---- backward ----
    def begin_backward(self, loss: torch.Tensor, *, boundary: bool, loss_scale: float = 1.0) -> None:
        """Before ``loss.backward()``: parameters that will get no gradient count as done at once
        ([Note: unused parameters] in unused.py). ``loss_scale``: what the loss was multiplied by (fp16)."""
        self.reducer.begin_backward(boundary=boundary)
        reached = reachable_leaves(loss)
        if reached is None:
            return
        for key, mark in self._no_grad_marks.items():
            if key not in reached:
                mark()

    def _track_frozen(self, params: list[nn.Parameter], on_grad: Callable[[], None] | None = None) -> None:
        """Parameters the optimizer does not update but autograd may give a gradient (trainable, yet not passed
        to the optimizer): they behave as frozen, their gradients are dropped as they arrive."""
        for param in params:
            if param.requires_grad:
                self._hooks.append(param.register_post_accumulate_grad_hook(_drop_grad(on_grad)))
                if on_grad is not None:
                    self._no_grad_marks[id(param)] = on_grad

    # ---- the step ----
    def step(self, *, loss_scale: float, clip_norm: float, check_overflow: bool) -> StepResult:
        self._collect_grads()
        if loss_scale != 1.0:
            self._scale_grads(1.0 / loss_scale)
        if check_overflow and self._overflow_anywhere():
            self.zero_grad()
            return StepResult(stepped=False, grad_norm=math.inf)
        norm = self.global_grad_norm()
        if clip_norm > 0:
            coefficient = min(clip_norm / (norm + 1e-6), 1.0)
            if coefficient < 1.0:
                self._scale_grads(coefficient)
        if self.tiled is not None:
            self._step_tiles()
        else:
            grads = self.grad_shards
            for master, (group, first) in zip(self.masters, self._master_at, strict=True):
                master.grad = grads[group][first : first + master.numel()]
            self.optimizer.step()
            for master in self.masters:
                master.grad = None
            self._publish_weights()
        self.zero_grad()
        return StepResult(stepped=True, grad_norm=norm)

    @property
    def grad_shards(self) -> list[torch.Tensor]:
        """The window's reduced fp32 gradient per group (stage 3: one flat shard), complete; none on NVMe."""
        return [] if self.gradients_in_memory is None else self.gradients_in_memory.tensors()

    def _collect_grads(self) -> None:
        """Brings the reduced gradients into grad_shards (stages 0-2 reduce straight into them)."""

    def _scale_grads(self, factor: float) -> None:
        for grad in self.grad_shards:
            grad.mul_(factor)

    def _publish_weights(self) -> None:
        raise NotImplementedError

    def _step_tiles(self) -> None:
        raise NotImplementedError

    def fp32_shards(self) -> list[torch.Tensor]:
        """This rank's fp32 masters, as new host tensors: per param group its shard (stages 0-2), or the whole flat
        shard with the masters in place (stage 3). Reads the tiles when offloaded (for checkpoints, tests)."""
        raise NotImplementedError

    def _local_overflow(self) -> bool:
        return any(not torch.isfinite(grad).all() for grad in self.grad_shards)

    def _overflow_anywhere(self) -> bool:
        flag = torch.tensor([1.0 if self._local_overflow() else 0.0], device=self.device)
        return bool(collectives.all_reduce_max_(self.comm, flag).item())

    def _local_squares(self) -> torch.Tensor:
        """This rank's share of the squared global norm, float64, on the device."""
        total = 0.0
        for grad in self.grad_shards:
            total += piece_squares(grad)
        return torch.tensor([total], dtype=torch.float64, device=self.device)

    def global_grad_norm(self) -> float:
        """L2 norm of the whole gradient: squares summed over this rank's disjoint pieces, then across ranks."""
        squares = self._local_squares()
        if self.stage > 0:
            collectives.all_reduce_sum_(self.comm, squares)
        return math.sqrt(squares.item())

    def zero_grad(self) -> None:
        """After the step, taken or skipped: the gradient and the spare reduce buffers are freed
        ([Note: gradient shards])."""
        if self.gradients_in_memory is not None:
            self.gradients_in_memory.free()
        self.reducer.drop_spares()

    # ---- accounting ----
    def state_bytes(self) -> int:
        """Bytes this rank holds for the optimizer: fp32 masters (unless the fp32 weights are the masters: fp32
        without offload, any stage) plus every optimizer state tensor."""
        if self.tiled is not None:
            return self.tiled.state_bytes()
        total = 0 if self.masters_are_weights else sum(m.numel() * m.element_size() for m in self.masters)
        for state in self.optimizer.state.values():
            total += sum(v.numel() * v.element_size() for v in state.values() if torch.is_tensor(v) and v.dim() > 0)
        return total

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        self._no_grad_marks.clear()
        if self.tiled is not None:
            self.tiled.close()


MAX_TILE_GATHERS = 2


@dataclass(slots=True)
class _TileGather:
    """A tile's weights (or a part of them, within allgather_bucket_size) on their way from every rank
    (ZeroOptimizer._step_tiles)."""

    pending: collectives.Pending
    gathered: torch.Tensor  # (world_size * numel,): rank r's part at [r * numel, (r + 1) * numel)
    flat: torch.Tensor  # the bucket's weights
    bucket: Bucket
    offset: int  # the part's first element within each rank's piece
    numel: int

    def land(self, own_rank: int) -> None:
        self.pending.wait()
        for rank in range(len(self.gathered) // self.numel):
            if rank != own_rank:  # the own range is where the gather read from
                first = self.bucket.piece_range(rank)[0] + self.offset
                self.flat[first : first + self.numel].copy_(self.gathered[rank * self.numel : (rank + 1) * self.numel])


def _gradient_shards(layouts, device: torch.device, offload: Offload | None) -> GradientShards:
    """The reduced gradient: in host memory when the optimizer is offloaded ([Note: gradient shards])."""
    offloaded = offload is not None and offload.home is not Tier.DEVICE
    return GradientShards.for_layouts(layouts, gradient_device(device, offloaded=offloaded),
                                      pin_memory=offloaded and offload.manager.pin_memory)  # fmt: skip


def _drop_grad(then: Callable[[], None] | None):
    def hook(param: torch.Tensor) -> None:
        param.grad = None
        if then is not None:
            then()

    return hook


class ZeroOptimizer(PartitionedOptimizer):
    """Stages 0, 1 and 2: parameters are views into per-bucket flat weights, complete on every rank."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        comm: Comm,
        stage: int,
        compute_dtype: torch.dtype,
        device: torch.device,
        bucket_numel: int,
        overlap_comm: bool,
        offload: Offload | None,
        frozen: list[nn.Parameter],
    ) -> None:
        """``frozen``: the model's parameters that are not in the optimizer; they are cast to the compute dtype
        and never updated. ``offload``: the masters and states go to tiles in host memory or on NVMe."""
        self.optimizer = optimizer
        self.comm = comm
        self.stage = stage
        self.compute_dtype = compute_dtype
        self.device = device
        shard_world = 1 if stage == 0 else comm.world_size
        self.shard_rank = 0 if stage == 0 else comm.rank
        self.groups: list[list[nn.Parameter]] = [list(g["params"]) for g in optimizer.param_groups]
        self.layouts: tuple[GroupLayout, ...] = plan(
            [[p.numel() for p in params] for params in self.groups], world_size=shard_world, bucket_numel=bucket_numel
        )
        self.weights: list[list[torch.Tensor]] = []  # [group][bucket] -> (padded_numel,) compute dtype
        self.masters: list[nn.Parameter] = []
        self._master_at: list[tuple[int, int]] = []  # per master: (group, first element in the group's shard)
        self.masters_are_weights = offload is None and compute_dtype == torch.float32
        self.gather_numel = None if offload is None else offload.gather_numel
        self.largest_gather_numel = 0  # the most elements one tile gather held (world size x its part)
        if offload is not None:
            runs = [(g, b.index, b.shard_offset, b.piece_numel) for g, layout in enumerate(self.layouts)
                    for b in layout.buckets]  # fmt: skip
            self.tiled = self._make_tiled(optimizer, runs, offload)
        for params, layout in zip(self.groups, self.layouts, strict=True):
            self._flatten_group(params, layout)
        if self.tiled is None:
            for group in optimizer.param_groups:
                group["params"] = []
            for master, (group, _) in zip(self.masters, self._master_at, strict=True):
                optimizer.param_groups[group]["params"].append(master)
            optimizer.state.clear()
        self.gradients_in_memory = _gradient_shards(self.layouts, device, offload)
        self.reducer = GradientReducer(
            comm=comm, stage=stage, layouts=self.layouts, gradients=self.gradients_in_memory,
            shard_rank=self.shard_rank, device=device, overlap_comm=overlap_comm,
        )  # fmt: skip
        self._hooks = []
        self._no_grad_marks = {}
        for g, (params, layout) in enumerate(zip(self.groups, self.layouts, strict=True)):
            for bucket in layout.buckets:
                index = self.reducer.state_index(g, bucket.index)
                for slot in bucket.slots:
                    param = params[slot.param_index]
                    self._hooks.append(param.register_post_accumulate_grad_hook(self._make_hook(index, slot.offset)))
                    self._no_grad_marks[id(param)] = functools.partial(self.reducer.on_no_grad, index)
        for param in frozen:
            if param.is_floating_point():
                param.data = param.data.to(device=device, dtype=compute_dtype)
        self._track_frozen(frozen)

    # ---- construction ----
    def _flatten_group(self, params: list[nn.Parameter], layout: GroupLayout) -> None:
        """Params become views into per-bucket flat weights; this rank's fp32 master pieces are copied out (into
        the tiles when offloaded: never a whole fp32 shard in memory then), or, where the weights are fp32 in
        memory, are the weights' own pieces (one master per bucket piece: no second fp32 copy of the shard)."""
        alias = self.masters_are_weights
        separate = self.tiled is None and not alias
        master = torch.empty(layout.shard_numel if separate else 0, dtype=torch.float32, device=self.device)
        weights = []
        for bucket in layout.buckets:
            values = (params[slot.param_index].detach() for slot in bucket.slots)
            flat = collectives.flat_from_rank0(self.comm, bucket, values, dtype=torch.float32, device=self.device)
            start, end = bucket.piece_range(self.shard_rank)
            if self.tiled is not None:
                for tile in self.tiled.tiles_of(layout.group, bucket.index):
                    first = start + tile.start - bucket.shard_offset
                    self.tiled.initialize(tile, flat[first : first + tile.numel])
            elif separate:
                master[bucket.shard_offset : bucket.shard_offset + bucket.piece_numel].copy_(flat[start:end])
            else:
                self.masters.append(nn.Parameter(flat[start:end]))
                self._master_at.append((layout.group, bucket.shard_offset))
            flat = flat.to(self.compute_dtype)
            for slot in bucket.slots:
                param = params[slot.param_index]
                param.data = flat[slot.offset : slot.offset + slot.numel].view(param.shape)
            weights.append(flat)
        self.weights.append(weights)
        if separate:
            self.masters.append(nn.Parameter(master))
            self._master_at.append((layout.group, 0))

    def _piece_view(self, tile: Tile) -> torch.Tensor:
        """The tile's elements in its bucket's compute-dtype flat weights."""
        bucket = self.layouts[tile.group].buckets[tile.piece]
        first = bucket.piece_range(self.shard_rank)[0] + tile.start - bucket.shard_offset
        return self.weights[tile.group][tile.piece][first : first + tile.numel]

    def _tile_grad(self, tile: Tile) -> torch.Tensor:
        return self.grad_shards[tile.group][tile.start : tile.start + tile.numel]

    def _tile_weight(self, tile: Tile) -> torch.Tensor:
        return self._piece_view(tile)

    def _step_tiles(self) -> None:
        """Each tile's new weights are all-gathered from every rank as soon as it has stepped, behind the following
        tiles' reads and writes (every rank cuts its piece of a bucket into the plan's tiles, at the same offsets,
        so tile k of each rank covers the same range of its piece: [Note: one plan] in memory/plan.py). A bucket
        gathered whole after its last tile would keep the disk idle while it travels (measured: stage 2 with one
        124M-element bucket, world size 2, disk busy 69% of the step). A gather holds world_size x its part of
        the tile: allgather_bucket_size elements at most (the plan's gather_numel per rank), so a tile larger
        than that travels in parts. At most MAX_TILE_GATHERS are in flight."""
        if not self.comm.active:
            self.tiled.step(self.optimizer.param_groups)
            return
        pending: deque[_TileGather] = deque()
        world = self.comm.world_size

        def on_tile(tile: Tile) -> None:
            bucket = self.layouts[tile.group].buckets[tile.piece]
            flat = self.weights[tile.group][tile.piece]
            part = tile.numel if self.gather_numel is None else self.gather_numel
            for first in range(0, tile.numel, part):
                numel = min(part, tile.numel - first)
                offset = tile.start - bucket.shard_offset + first  # within each rank's piece
                mine = bucket.piece_range(self.shard_rank)[0] + offset
                gathered = torch.empty(numel * world, dtype=flat.dtype, device=flat.device)
                self.largest_gather_numel = max(self.largest_gather_numel, gathered.numel())
                handle = collectives.all_gather_pieces(self.comm, gathered, flat[mine : mine + numel], async_op=True)
                pending.append(_TileGather(handle, gathered, flat, bucket, offset, numel))
                while len(pending) > MAX_TILE_GATHERS:
                    pending.popleft().land(self.shard_rank)

        self.tiled.step(self.optimizer.param_groups, on_tile)
        while pending:
            pending.popleft().land(self.shard_rank)

    def fp32_shards(self) -> list[torch.Tensor]:
        shards = [torch.zeros(layout.shard_numel, dtype=torch.float32) for layout in self.layouts]
        if self.tiled is None:
            for master, (group, first) in zip(self.masters, self._master_at, strict=True):
                shards[group][first : first + master.numel()].copy_(master.detach())
            return shards
        self.tiled.read_masters(lambda tile: shards[tile.group][tile.start : tile.start + tile.numel])
        return shards

    def _make_hook(self, state_index: int, offset: int):
        reducer = self.reducer

        def hook(param: torch.Tensor) -> None:
            reducer.on_grad(state_index, offset, param.grad)
            param.grad = None  # its values live in the fp32 bucket buffer now

        return hook

    def _publish_weights(self) -> None:
        """New low-precision pieces from the masters, gathered so every rank has the full weights."""
        pending = []
        for layout, weights in zip(self.layouts, self.weights, strict=True):
            for bucket, flat in zip(layout.buckets, weights, strict=True):
                start, end = bucket.piece_range(self.shard_rank)
                if self.masters_are_weights:
                    piece = flat[start:end]  # stepped in place
                else:
                    master = self.masters[layout.group]
                    piece = master.detach()[bucket.shard_offset : bucket.shard_offset + bucket.piece_numel]
                if self.stage == 0 or not self.comm.active:
                    if not self.masters_are_weights:
                        flat.copy_(piece)  # every element is ours: convert in place, nothing to gather
                else:
                    piece = piece.to(device=self.device, dtype=self.compute_dtype)
                    pending.append(collectives.all_gather_pieces(self.comm, flat, piece, async_op=True))
        for item in pending:
            item.wait()


class UnitOptimizer(PartitionedOptimizer):
    """Stage 3: the rank's shard is the concatenation of its pieces of every unit ([Note: units] in units.py).

    Units follow modules, optimizer param groups follow the user: a unit can hold parameters of several groups
    (a Linear's weight with decay, its bias without). The masters and states are tiles ([Note: tiles] in
    tiles.py): runs of one group's elements inside one unit piece, so a tile's gradient is a view of the reduced
    gradient shard and its new weights go straight into the unit's piece. Without offload the tiles live in
    device memory; offloaded, in host memory or on NVMe: the same tiles step either way."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        comm: Comm,
        table: UnitTable,
        compute_dtype: torch.dtype,
        device: torch.device,
        overlap_comm: bool,
        offload: Offload | None,
        sub_group_size: int,
        on_param_grad: Callable[[int], None],
    ) -> None:
        """``on_param_grad(unit)``: a parameter of the unit has its gradient, or gets none this backward (the
        coordinator releases units on it). Trainable parameters outside the optimizer behave as frozen."""
        self.optimizer = optimizer
        self.comm = comm
        self.stage = 3
        self.device = device
        self.table = table
        self.compute_dtype = compute_dtype
        groups = [list(g["params"]) for g in optimizer.param_groups]
        self.groups: list[list[nn.Parameter]] = groups  # the user's param groups (their lists hold tiles now)
        expected = [0] * len(table.units)
        owner: dict[int, int] = {}
        for g, params in enumerate(groups):
            for param in params:
                found = table.unit_of(param)
                if found is None:
                    raise ConfigError("an optimizer parameter is not a parameter of the model; pass model.parameters()")
                if owner.setdefault(id(param), g) != g:
                    raise ConfigError(f"a parameter appears in optimizer param groups {owner[id(param)]} and {g}")
                expected[found[0].index] += 1
        # Tiles follow the shard itself (no gather of the masters; gradients and weights are views), in device
        # memory without offload: offloaded or not, the same tiles step, so the results are the same.
        masters = None
        if offload is None:
            manager = TierManager(device=device)
            offload = Offload(manager, Tier.DEVICE, sub_group_size, pipeline_read=True, pipeline_write=True)
            if compute_dtype == torch.float32 and table.shards.home is Tier.DEVICE:
                masters = self._tile_weight  # the fp32 shard is the master ([Note: tiles] in tiles.py)
        self.tiled = self._make_tiled(optimizer, _unit_runs(table, owner, comm.rank), offload, masters)
        self.gradients: SwappedGradients | None = None
        self._grad_factors: list[float] = []
        if offload.gradients is not None:
            offsets = {unit.index: unit.bucket.shard_offset for unit in table.units}
            self.gradients = SwappedGradients(self.tiled.tiles, offload.gradients, unit_offsets=offsets)
            self.tiled.gradients = self.gradients
            self.gradients_in_memory = None  # [Note: swapped gradients]
        else:
            self.gradients_in_memory = _gradient_shards([table.layout], device, offload)
        self._tiles_of_unit: dict[int, list[Tile]] = {}
        for tile in self.tiled.tiles:
            self._tiles_of_unit.setdefault(tile.piece, []).append(tile)
        # Units whose tiles cover every element of the rank's piece that holds a parameter: the step writes the
        # whole piece, so an offloaded one is not read back first.
        self._tiles_cover = {
            unit for unit, tiles in self._tiles_of_unit.items()
            if sum(t.numel for t in tiles) == table.shards.held_numel(unit)
        }  # fmt: skip
        self._tiles_as_parameters()  # they share the tiles' memory: initialize_piece fills both
        self._last_tile = {t.piece: t.index for t in self.tiled.tiles}
        self.masters = []
        self.reducer = GradientReducer(
            comm=comm, stage=3, layouts=(table.layout,), gradients=self.gradients_in_memory, shard_rank=comm.rank,
            device=device, overlap_comm=overlap_comm, expected=expected, keep_spares=False, max_in_flight=None,
            deliver=None if self.gradients is None else self.gradients.deliver,
        )  # fmt: skip
        self._hooks = []
        self._no_grad_marks = {}
        self.grad_params_per_unit = [0] * len(table.units)
        for params in groups:
            for param in params:
                unit, position = table.unit_of(param)
                hook = self._make_hook(unit.index, unit.bucket.slots[position].offset, on_param_grad)
                self._hooks.append(param.register_post_accumulate_grad_hook(hook))
                self._no_grad_marks[id(param)] = functools.partial(self._no_grad, unit.index, on_param_grad)
                self.grad_params_per_unit[unit.index] += 1
        for unit in table.units:
            orphans = [p for p in unit.params if p.requires_grad and id(p) not in owner]
            self._track_frozen(orphans, functools.partial(on_param_grad, unit.index))
            self.grad_params_per_unit[unit.index] += len(orphans)

    def initialize_piece(self, unit: Unit, piece: torch.Tensor) -> None:
        """The unit's piece arrived (``fill_units``, fp32): its tiles' masters start from it."""
        for tile in self._tiles_of_unit.get(unit.index, ()):
            first = tile.start - unit.bucket.shard_offset
            self.tiled.initialize(tile, piece[first : first + tile.numel])

    def _make_hook(self, unit_index: int, offset: int, on_param_grad: Callable[[int], None]):
        reducer = self.reducer

        def hook(param: torch.Tensor) -> None:
            reducer.on_grad(unit_index, offset, param.grad)
            param.grad = None
            on_param_grad(unit_index)

        return hook

    def _no_grad(self, unit_index: int, on_param_grad: Callable[[int], None]) -> None:
        self.reducer.on_no_grad(unit_index)
        on_param_grad(unit_index)

    def _tile_grad(self, tile: Tile) -> torch.Tensor:
        return self.grad_shards[0][tile.start : tile.start + tile.numel]

    def begin_backward(self, loss: torch.Tensor, *, boundary: bool, loss_scale: float = 1.0) -> None:
        if self.gradients is not None:
            self.gradients.begin_backward(boundary=boundary, loss_scale=loss_scale)
        super().begin_backward(loss, boundary=boundary, loss_scale=loss_scale)

    def _scale_grads(self, factor: float) -> None:
        if self.gradients is not None:
            self._grad_factors.append(factor)  # applied per tile as it steps
        else:
            super()._scale_grads(factor)

    def _local_overflow(self) -> bool:
        return self.gradients.nonfinite if self.gradients is not None else super()._local_overflow()

    def _local_squares(self) -> torch.Tensor:
        """Per unit piece holding tiles, summed in unit order, wherever the gradient lives ([Note: swapped
        gradients] in grads.py)."""
        total = 0.0
        for unit in sorted(self._tiles_of_unit):
            if self.gradients is not None:
                total += self.gradients.squares.get(unit, 0.0)
            else:
                bucket = self.table.layout.buckets[unit]
                flat = self.grad_shards[0]
                total += piece_squares(flat[bucket.shard_offset : bucket.shard_offset + bucket.piece_numel])
        return torch.tensor([total], dtype=torch.float64, device=self.device)

    def _tile_weight(self, tile: Tile) -> torch.Tensor:
        """The tile's elements of its unit's piece, held writable until the unit's last tile (then committed)."""
        first = tile.start - self.table.layout.buckets[tile.piece].shard_offset
        piece = self.table.shards.edit(tile.piece, overwrite=tile.piece in self._tiles_cover)
        return piece[first : first + tile.numel]

    def _step_tiles(self) -> None:
        last = self._last_tile

        def on_tile(tile: Tile) -> None:
            if tile.index == last[tile.piece]:
                self.table.shards.commit(tile.piece)  # offloaded shards go back, behind the next tiles

        self.tiled.step(self.optimizer.param_groups, on_tile, self.optimizer, grad_factors=self._grad_factors)
        self._regather_persistent()

    def fp32_shards(self) -> list[torch.Tensor]:
        flat = self.table.shards.snapshot().float()
        self.tiled.read_masters(lambda tile: flat[tile.start : tile.start + tile.numel])
        return [flat]

    def _regather_persistent(self) -> None:
        for unit in self.table.units:
            if unit.persistent:
                unit.gather(self.comm, self.table.shards, async_op=False)

    def load_unit_piece(self, unit: Unit) -> None:
        """The unit's shard was edited (GatheredParameters with modifier_rank): masters follow."""
        piece = self.table.shards.read(unit.index)
        start = unit.bucket.shard_offset

        def edited(tile: Tile) -> torch.Tensor:
            first = tile.start - start
            return piece[first : first + tile.numel].float()

        self.tiled.load_masters([t for t in self.tiled.tiles if t.piece == unit.index], edited)

    def zero_grad(self) -> None:
        self._grad_factors.clear()
        if self.gradients is not None:
            self.tiled.drop_gradients_ahead()
            self.gradients.zero()
        super().zero_grad()


def _unit_runs(table: UnitTable, group_of: dict[int, int], rank: int) -> list[tuple[int, int, int, int]]:
    """(group, unit, start, numel) runs of the rank's flat shard: consecutive elements of optimized parameters
    of one group inside one unit piece (padding and parameters outside the optimizer are in none)."""
    runs: list[list[int]] = []
    for unit in table.units:
        start, end = unit.bucket.piece_range(rank)
        for slot, param in zip(unit.bucket.slots, unit.params, strict=True):
            group = group_of.get(id(param))
            part = overlap(slot, start, end)
            if group is None or part is None:
                continue
            first = unit.bucket.shard_offset + part[0] - start
            numel = part[1] - part[0]
            last = runs[-1] if runs else None
            if last is not None and last[0] == group and last[1] == unit.index and last[2] + last[3] == first:
                last[3] += numel
            else:
                runs.append([group, unit.index, first, numel])
    return [tuple(run) for run in runs]
