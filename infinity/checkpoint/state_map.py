"""Where each saved array's elements live on this rank, for every stage and offload mode.

[Note: checkpoint state map]
A checkpoint holds, per parameter (by its module path): ``params/<name>`` (the fp32 master of a parameter the
optimizer updates, else the parameter itself) and ``optimizer/<state>/<name>`` (exp_avg, exp_avg_sq, ...); per
persistent buffer ``buffers/<name>``. A rank holds these as pieces of flat shards: regions (a bucket of a param
group at stages 0-2, a unit at stage 3) whose fragments say which element range of which parameter sits where.
The values come in blocks: an offloaded or stage-3 optimizer's tiles (one segment at a time, read from NVMe and
given back, never the whole shard in memory), or the masters the user's optimizer steps. Saving and loading walk
the same regions in the same order on every rank, so the chunk exchange ([Note: chunk ownership]) lines up, and
a load takes whatever ranges the loading layout gives this rank: another world size, stage or offload mode reads
other ranges of the same arrays.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from infinity.checkpoint.chunks import ArraySpec
from infinity.checkpoint.zarr_store import ArrayMeta
from infinity.errors import CheckpointError
from infinity.zero.bucket_optimizer import ZeroOptimizer
from infinity.zero.elementwise import decode_scalar, encode_scalar
from infinity.zero.optimizer import PartitionedOptimizer
from infinity.zero.partition import Bucket, overlap
from infinity.zero.tiles import Tile
from infinity.zero.unit_optimizer import UnitOptimizer

PARAMS = "params/"
BUFFERS = "buffers/"
OPTIMIZER = "optimizer/"


def state_key(state: str, name: str) -> str:
    return f"{OPTIMIZER}{state}/{name}"


@dataclass(frozen=True, slots=True)
class Fragment:
    """Elements [param_start, param_start + numel) of parameter ``name`` at ``offset`` in the region's space."""

    name: str
    param_start: int
    numel: int
    offset: int


@dataclass(slots=True)
class Region:
    """A bucket (stages 0-2) or unit (stage 3): the grain at which ranks exchange chunk pieces."""

    group: int  # the param group (stages 0-2); -1 at stage 3 (a unit mixes groups)
    piece: int  # bucket index within the group, or unit index
    start: int  # the rank's piece in shard coordinates
    numel: int
    optimized: list[Fragment] = field(default_factory=list)  # values from the optimizer's masters and states
    others: list[Fragment] = field(default_factory=list)  # stage 3: parameters outside the optimizer, in the piece
    keeps_frozen: bool = False  # frozen parameters' elements in the piece are not in the map (exclude_frozen)


@dataclass(slots=True)
class Block:
    """Values for shard range [start, start + numel): the master (fp32) and the optimizer states, as views."""

    start: int
    numel: int
    master: torch.Tensor | None
    states: dict[str, torch.Tensor]
    transient: bool = False  # its memory is a ring buffer, reused once given back: I/O on it must be drained


def parameter_names(module: nn.Module) -> tuple[dict[int, str], dict[str, list[str]]]:
    """id(param) -> its name (the first registration), and name -> the other names of a tied parameter."""
    first: dict[int, str] = {}
    aliases: dict[str, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        if id(param) in first:
            aliases.setdefault(first[id(param)], []).append(name)
        else:
            first[id(param)] = name
    return first, aliases


def persistent_buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    keys = set(module.state_dict(keep_vars=True))
    return {name: buffer for name, buffer in module.named_buffers() if name in keys}


def overlaps(fragments: list[Fragment], start: int, numel: int) -> Iterator[tuple[Fragment, int, int]]:
    """(fragment, lo, hi): the parts of the fragments inside region-space [start, start + numel)."""
    for fragment in fragments:
        lo = max(fragment.offset, start)
        hi = min(fragment.offset + fragment.numel, start + numel)
        if lo < hi:
            yield fragment, lo, hi


def _owners(slot, bucket: Bucket, ranks: int) -> tuple[tuple[int, int], ...]:
    owned = []
    for rank in range(ranks):
        part = overlap(slot, *bucket.piece_range(rank))
        owned.append((0, 0) if part is None else (part[0] - slot.offset, part[1] - slot.offset))
    return tuple(owned)


class StateMap:
    """The layout of one engine's state for checkpoints ([Note: checkpoint state map])."""

    def __init__(self, *, module: nn.Module, optimizer: PartitionedOptimizer, world_size: int, rank: int,
                 steps_taken: int = 0) -> None:  # fmt: skip
        """``steps_taken``: optimizer steps the run has taken (not skipped), for an optimizer whose state does not
        count them (SGD)."""
        self.module = module
        self.steps_taken = steps_taken
        self.optimizer = optimizer
        self.world_size = world_size
        self.rank = rank
        self.names, self.aliases = parameter_names(module)
        self.buffers = persistent_buffers(module)
        self.specs: dict[str, ArraySpec] = {}
        self.regions: list[Region] = []
        self.replicated: list[tuple[str, nn.Parameter]] = []  # parameters every rank holds whole, unpartitioned
        self.frozen_excluded: list[str] = []  # frozen parameters left out of the map (exclude_frozen)
        self.optimized: dict[str, tuple] = {}  # name -> (shape, owners) of the parameters the optimizer updates
        self.group_names: list[list[str]] = [[] for _ in optimizer.param_groups]
        self.state_names = self._state_names()
        if isinstance(optimizer, UnitOptimizer):
            self._map_units(optimizer)
        else:
            self._map_buckets(optimizer)
        for name, buffer in self.buffers.items():
            self._spec(BUFFERS + name, tuple(buffer.shape), buffer.dtype, None)

    # ---- building the map ----
    def _name(self, param: nn.Parameter) -> str:
        name = self.names.get(id(param))
        if name is None:
            raise CheckpointError("an optimizer parameter is not a parameter of the model")
        return name

    def _spec(self, key: str, shape: tuple[int, ...], dtype: torch.dtype, owners) -> None:
        self.specs[key] = ArraySpec(key, ArrayMeta.plan(shape, dtype), owners)

    def _optimized(self, name: str, shape, owners) -> None:
        self.optimized[name] = (shape, owners)
        self._spec(PARAMS + name, shape, torch.float32, owners)
        for state in self.state_names:
            self._spec(state_key(state, name), shape, torch.float32, owners)

    def _map_buckets(self, optimizer: ZeroOptimizer) -> None:
        ranks = 1 if optimizer.stage == 0 else self.world_size
        for g, (params, layout) in enumerate(zip(optimizer.groups, optimizer.layouts, strict=True)):
            for bucket in layout.buckets:
                start, end = bucket.piece_range(optimizer.shard_rank)
                region = Region(g, bucket.index, bucket.shard_offset, bucket.piece_numel)
                for slot in bucket.slots:
                    param = params[slot.param_index]
                    name = self._name(param)
                    self.group_names[g].append(name)
                    owners = None if ranks == 1 else _owners(slot, bucket, ranks)
                    self._optimized(name, tuple(param.shape), owners)
                    part = overlap(slot, start, end)
                    if part is not None:
                        offset = bucket.shard_offset + part[0] - start
                        region.optimized.append(Fragment(name, part[0] - slot.offset, part[1] - part[0], offset))
                self.regions.append(region)
        optimized = {id(p) for params in optimizer.groups for p in params}
        for param in self.module.parameters():
            if id(param) not in optimized:
                name = self._name(param)
                self.replicated.append((name, param))
                self._spec(PARAMS + name, tuple(param.shape), param.dtype, None)

    def _map_units(self, optimizer: UnitOptimizer) -> None:
        table = optimizer.table
        group_of = {id(p): g for g, group in enumerate(optimizer.groups) for p in group}
        for unit in table.units:
            bucket = unit.bucket
            start, end = bucket.piece_range(self.rank)
            region = Region(-1, unit.index, bucket.shard_offset, bucket.piece_numel)
            for slot, param, shape in zip(bucket.slots, unit.params, unit.shapes, strict=True):
                name = self._name(param)
                owners = _owners(slot, bucket, self.world_size)
                group = group_of.get(id(param))
                if group is None:
                    self._spec(PARAMS + name, tuple(shape), table.shards.dtype, owners)
                else:
                    self._optimized(name, tuple(shape), owners)
                part = overlap(slot, start, end)
                if part is not None:
                    offset = bucket.shard_offset + part[0] - start
                    fragment = Fragment(name, part[0] - slot.offset, part[1] - part[0], offset)
                    (region.others if group is None else region.optimized).append(fragment)
            self.regions.append(region)
        for g, group in enumerate(optimizer.groups):
            self.group_names[g] = [self._name(p) for p in group]

    def exclude_frozen(self, only: set[str] | None = None) -> None:
        """Leaves out the parameters the optimizer does not update (save_checkpoint's exclude_frozen_parameters: a
        LoRA fine-tune's base weights, which the loading run takes from elsewhere), or those of them in ``only``
        (a load: the ones the checkpoint left out); their names go to ``frozen_excluded``. The names come from the
        whole model, the same on every rank, not from the fragments this rank holds."""
        frozen = [key.removeprefix(PARAMS) for key in self.specs
                  if key.startswith(PARAMS) and key.removeprefix(PARAMS) not in self.optimized]  # fmt: skip
        names = {name for name in frozen if only is None or name in only}
        self.replicated = [(n, p) for n, p in self.replicated if n not in names]
        for region in self.regions:
            kept = [f for f in region.others if f.name not in names]
            if len(kept) != len(region.others):
                region.others = kept
                region.keeps_frozen = True
        self.frozen_excluded = [name for name in frozen if name in names]
        for name in self.frozen_excluded:
            del self.specs[PARAMS + name]

    def refresh_state_names(self) -> None:
        """The user's optimizer makes its states at its first step: names known since the map was built."""
        self.state_names = tuple(dict.fromkeys((*self.state_names, *self._state_names())))

    def _state_names(self) -> tuple[str, ...]:
        """The optimizer's per-element states: the tiles' rule, or what the user's optimizer holds (nothing
        before its first step)."""
        tiled = self.optimizer.tiled
        if tiled is not None and tiled.rule.update is not None:
            return tiled.rule.states
        names: list[str] = []
        for param, state in self._torch_states():
            for key, value in state.items():
                if torch.is_tensor(value) and value.shape == param.shape and value.dim() > 0 and key not in names:
                    names.append(key)
        return tuple(names)

    def _torch_states(self) -> Iterator[tuple[torch.Tensor, dict]]:
        for param in self._torch_params():
            state = self.optimizer.optimizer.state.get(param)
            if state:
                yield param, state

    def _torch_params(self) -> list[torch.Tensor]:
        tiled = self.optimizer.tiled
        return tiled.params if tiled is not None else self.optimizer.masters

    # ---- the values, block by block ----
    def blocks(self, region: Region, *, dirty: bool, with_states: bool = True, overwrite: bool = False
               ) -> Iterator[Block]:  # fmt: skip
        """The region's values in blocks (tiles are acquired and given back, ``dirty`` when changed; ``overwrite``:
        the caller writes every element of each block, master and states, so an offloaded tile is not read)."""
        tiled = self.optimizer.tiled
        if tiled is not None and tiled.rule.update is not None:
            mine = region.group < 0  # stage 3: a unit's tiles of every group
            tiles = [t for t in tiled.tiles if t.piece == region.piece and (mine or t.group == region.group)]
            yield from self._tile_blocks(tiles, dirty=dirty, with_states=with_states, overwrite=overwrite)
            return
        for param, (group, first) in self._torch_pieces():
            if region.group >= 0 and group != region.group:
                continue
            lo, hi = max(first, region.start), min(first + param.numel(), region.start + region.numel)
            if lo >= hi:
                continue
            state = self.optimizer.optimizer.state.get(param, {})
            states = {k: state[k].detach().view(-1)[lo - first : hi - first] for k in self.state_names if k in state}
            master = param.detach().view(-1)[lo - first : hi - first]  # stages 0-2 fp32: a view of the weights
            yield Block(lo, hi - lo, master, states if with_states else {})

    def _torch_pieces(self) -> list[tuple[torch.Tensor, tuple[int, int]]]:
        tiled = self.optimizer.tiled
        if tiled is not None:  # a rule without update: the user's optimizer steps the tiles' masters
            return [(p, (t.group, t.start)) for t, p in zip(tiled.tiles, tiled.params, strict=True)]
        return list(zip(self.optimizer.masters, self.optimizer._master_at, strict=True))

    def _tile_blocks(self, tiles: list[Tile], *, dirty: bool, with_states: bool, overwrite: bool) -> Iterator[Block]:
        """The tiles' segments one after another, the next one's read started before this one is handed out (one
        ahead, when a ring buffer is free). ``overwrite``: the caller fills every element, so nothing is read."""
        tiled = self.optimizer.tiled
        manager = tiled.manager
        tiled.drop_ahead()  # reads a step started would hold buffers (and values) of the tiles
        ahead: dict[int, object] = {}
        try:
            for index, tile in enumerate(tiles):
                handle = ahead.pop(index, None) or manager.acquire(tile.name, read=not overwrite)
                if index + 1 < len(tiles):
                    following = manager.acquire(tiles[index + 1].name, block=False, read=not overwrite)
                    if following is not None:
                        ahead[index + 1] = following
                try:
                    segment = handle.wait()
                    if overwrite:
                        segment.zero_()  # a ring buffer holds another tile's values: its padding must not keep them
                    master = None
                    if tiled.masters is None:  # a split master to be overwritten is not joined first
                        master = tiled.blank_master(tile, segment) if overwrite else tiled._master(tile, segment)
                    values = tiled.states_of(tile, segment) if with_states or overwrite else []
                    states = dict(zip(tiled.rule.states, values, strict=True)) if values else {}
                    # transient: the values live in a ring buffer, or (compact states, split masters) in the
                    # step's workspaces, which the next tile reuses: checkpoint I/O on them must finish first
                    transient = handle.in_ring or (tiled.codecs is not None and bool(values))
                    transient = transient or (master is not None and tiled.masters_transient)
                    yield Block(tile.start, tile.numel, master, states if with_states else {}, transient=transient)
                    if dirty or overwrite:
                        if values:
                            tiled.store_states(tile, segment, values)  # compact states: encoded back
                        if master is not None:
                            tiled.store_master(tile, segment, master)
                finally:
                    manager.release(handle, dirty=dirty)
        finally:
            for handle in ahead.values():
                manager.release(handle, dirty=False)
            tiled.end_visit()  # a copy of the weights taken to join split masters goes
        manager.flush()

    # ---- per-group scalars ----
    def group_steps(self) -> list[int]:
        """Optimizer steps taken per param group."""
        tiled = self.optimizer.tiled
        if tiled is not None and tiled.rule.update is not None:
            return list(tiled.steps)
        steps = [0] * len(self.optimizer.param_groups)
        for param, (group, _) in self._torch_pieces():
            state = self.optimizer.optimizer.state.get(param, {})
            step = state.get("step")
            if step is not None:
                steps[group] = int(step.item() if torch.is_tensor(step) else step)
            elif state:  # it has stepped, and keeps no count (SGD's momentum_buffer)
                steps[group] = self.steps_taken
        return steps

    def scalar_keys(self) -> list[str]:
        """Non-elementwise entries of the optimizer's state (Adam's "step")."""
        tiled = self.optimizer.tiled
        if tiled is not None and tiled.rule.stepper is not None:
            return list(tiled.rule.stepper.scalar_keys)
        if tiled is not None and tiled.rule.update is not None:
            return ["step"] if "exp_avg" in tiled.rule.states else []
        keys: list[str] = []
        for _, state in self._torch_states():
            keys += [k for k in state if k not in self.state_names and k not in keys]
        return keys

    def group_scalars(self) -> list[dict]:
        """Per param group, the scalar state entries other than Adam's step count (NAdam's mu_product, ASGD's eta
        and mu), as JSON: the same for every element of a group ([Note: elementwise optimizers])."""
        tiled = self.optimizer.tiled
        groups = len(self.optimizer.param_groups)
        if tiled is not None and tiled.rule.stepper is not None:
            return [tiled.rule.stepper.saved_scalars(g) for g in range(groups)]
        found: list[dict] = [{} for _ in range(groups)]
        if tiled is not None and tiled.rule.update is not None:
            return found
        for param, (group, _) in self._torch_pieces():
            state = self.optimizer.optimizer.state.get(param, {})
            for key, value in state.items():
                if key not in self.state_names and (not torch.is_tensor(value) or value.dim() == 0):
                    found[group].setdefault(key, encode_scalar(value))
        return found

    def set_group_steps(self, steps: list[int], scalar_keys: list[str], scalars: list[dict] | None = None) -> None:
        """After loading states: the step counts (the tiles'), or the user's optimizer's scalar entries (a group
        that had not stepped gets no state at all, as a fresh optimizer). ``scalars``: group_scalars() as saved."""
        tiled = self.optimizer.tiled
        scalars = scalars or [{} for _ in steps]
        if tiled is not None and tiled.rule.stepper is not None:
            tiled.steps = list(steps)
            for group, (taken, saved) in enumerate(zip(steps, scalars, strict=True)):
                tiled.rule.stepper.load_scalars(group, saved, taken)
            return
        if tiled is not None and tiled.rule.update is not None:
            tiled.steps = list(steps)
            return
        torch_state = self.optimizer.optimizer.state
        for param, (group, _) in self._torch_pieces():
            if steps[group] == 0:
                torch_state.pop(param, None)
                continue
            state = torch_state.setdefault(param, {})
            for key in scalar_keys:
                if key != "step" and key in scalars[group]:
                    value = decode_scalar(scalars[group][key])
                    state[key] = value.to(param.device) if torch.is_tensor(value) and param.is_cuda else value
                elif key == "step":
                    fused = self.optimizer.param_groups[group].get("fused") or self.optimizer.param_groups[
                        group].get("capturable")  # fmt: skip
                    state[key] = torch.tensor(float(steps[group]), dtype=torch.float32,
                                              device=param.device if fused else "cpu")  # fmt: skip

    def declare_states(self, names: list[str]) -> None:
        """The checkpoint's per-element states become arrays of this map too (the user's optimizer has none
        before its first step); nothing is created yet (``make_states``)."""
        self.state_names = tuple(dict.fromkeys((*self.state_names, *names)))
        for name, (shape, owners) in self.optimized.items():
            for state in self.state_names:
                self._spec(state_key(state, name), shape, torch.float32, owners)

    def make_states(self, names: list[str], steps: list[int]) -> None:
        """The user's optimizer gets zero states to load into, in the groups that had stepped."""
        tiled = self.optimizer.tiled
        if tiled is not None and tiled.rule.update is not None:
            return
        torch_state = self.optimizer.optimizer.state
        for param, (group, _) in self._torch_pieces():
            if steps[group] == 0:
                continue
            state = torch_state.setdefault(param, {})
            for name in names:
                if not torch.is_tensor(state.get(name)):
                    state[name] = torch.zeros_like(param, memory_format=torch.preserve_format)
