"""Optimizer tiles: the offloaded optimizer step, one contiguous range of a param group's elements at a time.

[Note: tiles]
With offload_optimizer, a rank's fp32 masters and optimizer states are cut into tiles: a tile is a contiguous
range of one param group's elements inside one bucket piece (stages 1-2) or one unit piece (stage 3), at most
``tile_numel`` elements. Its master and states form one segment of the tier manager ([Note: tiers] in
memory/tiers.py): [master | state 1 | state 2 ...], fp32, so an NVMe tile moves in one read and one write.
Where the weights themselves are fp32 in device memory (stage 3, fp32, nothing offloaded) the master is the
weight: the segment holds the states only, and no second fp32 copy of the shard exists.
With bf16 weights and infinity.offloaded_master "split" the segment holds the master's 16 low bits only; the
step joins it with the tile's weights, read before they are written ([Note: split masters] in
split_master.py).

The step walks the tiles in order. For each: wait for its segment, run torch's own functional update for the
user's optimizer class (Adam / AdamW / SGD's kernels here, any other elementwise class's own step: [Note:
elementwise optimizers] in elementwise.py; with the hyperparameters and flags read from the user's
param_groups at every step, so LR schedulers keep working; the step count per group is kept here), copy the
new master into the compute-dtype weights, give the segment back dirty. With NVMe, reads of the next tiles
are in flight while one steps and earlier writes drain behind it, within the ring's buffer_count buffers; the
first tiles' reads start at the end of backward (``prefetch``; a step behind the forward: at its start, into the
whole ring, without the gradients backward is writing), and the last writes finish behind the next forward (a
buffer is waited for only when it is needed again). A step can also be taken in parts
(``begin_step``, ``step_tiles`` for any group of its tiles, ``end_step``): stage 3 steps each unit's tiles
behind the next forward ([Note: step behind forward] in unit_optimizer.py), reading ahead along the order it
expects, and reads started for tiles taken out of that order make way when the ring runs out.

Elementwise updates do not care where a tensor is cut, so tiles change nothing in the math: the results are
those of the same torch kernel on the whole shard (tests/distributed/test_offload.py checks it bitwise).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch.optim import adam, sgd

from infinity.errors import ConfigError
from infinity.memory.tiers import SegmentHandle, Tier, TierManager
from infinity.zero.compact import StateCodec
from infinity.zero.elementwise import ElementwiseStep, GroupStart
from infinity.zero.split_master import MasterSplitter, stored_master_bytes


@dataclass(frozen=True, slots=True)
class Tile:
    index: int
    group: int
    start: int  # first element in the rank's shard space (stages 1-2: the group's shard; 3: the flat shard)
    numel: int
    piece: int  # the bucket (stages 1-2, within the group) or unit (stage 3) whose piece holds it

    @property
    def name(self) -> str:
        return f"tile{self.index}.g{self.group}.p{self.piece}"


SIMD_NUMEL = 64  # tiles are cut at multiples of this: see cut()


def cut(runs: Sequence[tuple[int, int, int, int]], tile_numel: int) -> list[Tile]:
    """Tiles from runs of (group, piece, start, numel), each split into pieces of at most ``tile_numel``, rounded
    down to a multiple of SIMD_NUMEL (at least that). Why: torch's fused Adam runs SIMD lanes from a tensor's
    start and a scalar loop over its last numel % width elements, and the two round differently (the vector body
    uses fused multiply-adds). Measured with AVX2: chunks of any size not a multiple of 8 change results by an
    ulp; multiples of 8 leave them bitwise equal to one call on the whole tensor. 64 covers AVX-512 too."""
    if tile_numel < 1:
        raise ConfigError(f"zero_optimization.sub_group_size must be >= 1, got {tile_numel}")
    tile_numel = max(tile_numel // SIMD_NUMEL * SIMD_NUMEL, SIMD_NUMEL)
    tiles: list[Tile] = []
    for group, piece, start, numel in runs:
        for offset in range(0, numel, tile_numel):
            tiles.append(Tile(len(tiles), group, start + offset, min(tile_numel, numel - offset), piece))
    return tiles


# ---- the update rules: torch's functional kernels, driven per tile ----
@dataclass(frozen=True, slots=True)
class Rule:
    """How one optimizer class steps a tile: the states it keeps (after the master) and the update."""

    states: tuple[str, ...]
    update: Callable[[dict, torch.Tensor, torch.Tensor, list[torch.Tensor], int], None] | None
    # None: the user's own optimizer steps the tiles' masters as its parameters (tiles in device memory only)
    stepper: ElementwiseStep | None = None  # any other elementwise class: its own step, tile by tile
    starts: list[GroupStart] | None = None  # without update: how the class's state starts (seed_states)


def _adam_update(group: dict, master, grad, states, step: int) -> None:
    beta1, beta2 = group["betas"]
    amsgrad = group.get("amsgrad", False)
    adam.adam(
        [master], [grad], [states[0]], [states[1]], [states[2]] if amsgrad else [],
        [torch.tensor(float(step), dtype=torch.float32, device=master.device if group.get("fused") else "cpu")],
        foreach=group.get("foreach"), capturable=False, differentiable=False, fused=group.get("fused"),
        decoupled_weight_decay=group.get("decoupled_weight_decay", False), amsgrad=amsgrad, beta1=beta1,
        beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
        maximize=group.get("maximize", False),
    )  # fmt: skip


def _sgd_update(group: dict, master, grad, states, step: int) -> None:
    momentum = group.get("momentum", 0)
    # torch's first momentum step takes the gradient itself as the buffer (no dampening): pass None then.
    buffers = [states[0] if step > 0 else None] if momentum else [None]
    sgd.sgd(
        [master], [grad], buffers, foreach=group.get("foreach"), fused=group.get("fused"),
        weight_decay=group.get("weight_decay", 0), momentum=momentum, lr=group["lr"],
        dampening=group.get("dampening", 0), nesterov=group.get("nesterov", False),
        maximize=group.get("maximize", False),
    )  # fmt: skip
    if momentum and step == 0:
        states[0].copy_(buffers[0])


def rule_for(optimizer: torch.optim.Optimizer, *, in_memory: bool = False) -> Rule:
    """The update of ``optimizer``'s class: torch's Adam, AdamW and SGD kernels driven here; any other class once
    its step is found elementwise ([Note: elementwise optimizers] in elementwise.py; else a ConfigError naming
    it): with tiles in device memory (``in_memory``) the user's optimizer steps them as its parameters, offloaded
    its own step runs tile by tile."""
    if type(optimizer) in (torch.optim.Adam, torch.optim.AdamW):  # exactly: a subclass may step otherwise
        amsgrad = any(g.get("amsgrad", False) for g in optimizer.param_groups)
        if any(g.get("capturable") or g.get("differentiable") for g in optimizer.param_groups):
            raise ConfigError("offload_optimizer: Adam with capturable or differentiable is not supported")
        return Rule(("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if amsgrad else ("exp_avg", "exp_avg_sq"), _adam_update)
    if type(optimizer) is torch.optim.SGD:
        momentum = any(g.get("momentum", 0) for g in optimizer.param_groups)
        return Rule(("momentum_buffer",) if momentum else (), _sgd_update)
    stepper = ElementwiseStep(optimizer)
    if in_memory:
        return Rule((), None, starts=stepper.starts)
    return Rule(stepper.states, stepper.update, stepper)


@dataclass(slots=True)
class _Run:
    """A step under way: what it steps with, the order its tiles are expected in, the ones stepped."""

    groups: list[dict]  # the param groups' hyperparameters for this step
    grad_factors: tuple[float, ...]
    order: list[Tile]
    position: dict[int, int]  # tile index -> place in ``order``
    stepped: set[int] = field(default_factory=set)

    def following(self, tile: Tile, count: int) -> list[Tile]:
        """The next ``count`` tiles after ``tile`` in the expected order that are not stepped yet."""
        found = []
        for candidate in self.order[self.position[tile.index] + 1 :]:
            if candidate.index not in self.stepped:
                found.append(candidate)
                if len(found) == count:
                    break
        return found


def _snapshot(value):
    """A hyperparameter as it is now: a tensor (an lr a scheduler fills in place) or a tuple of them copied."""
    if torch.is_tensor(value):
        return value.clone()
    if isinstance(value, tuple):
        return tuple(_snapshot(item) for item in value)
    return value


def _give_back(release: Callable[..., None], handle: SegmentHandle) -> None:
    """A tile's buffer after a failure: back to its ring, the segment unchanged on disk (a failed read raises
    again: the failure being raised already says it)."""
    with contextlib.suppress(Exception):  # the original error is on its way up
        release(handle, dirty=False)


class TiledStep:
    """Runs the step over the tiles through the tier manager ([Note: tiles])."""

    def __init__(
        self,
        *,
        tiles: list[Tile],
        rule: Rule,
        manager: TierManager,
        home: Tier,
        grads: Callable[[Tile], torch.Tensor],
        weights: Callable[[Tile], torch.Tensor],
        groups: int,
        pipeline_read: bool = True,
        pipeline_write: bool = True,
        gradients=None,
        masters: Callable[[Tile], torch.Tensor] | None = None,
        codecs: Sequence[StateCodec] | None = None,
        split_masters: Callable[[Tile], torch.Tensor] | None = None,
        forget_weights: Callable[[], None] | None = None,
    ) -> None:
        """``gradients``: a SwappedGradients (grads.py) when the gradient is on NVMe too; it is read ahead with
        the tiles, and ``grads`` is not used. ``masters``: where the tile's fp32 master already lives, when the
        weights are fp32 in memory (the master is the weight: no copy, and the segment holds only the states).
        ``codecs``: how each state is stored ([Note: compact states] in compact.py); None or all fp32: as is.
        ``split_masters``: the masters are stored as residuals beside the bf16 weights ([Note: split masters] in
        split_master.py); it gives a tile's current weights outside the step (read only, may be a copy, which
        ``forget_weights`` lets go of once a visit of the tiles ends)."""
        self.tiles = tiles
        self.gradients = gradients
        self.masters = masters
        self.rule = rule
        self.manager = manager
        self.grads = grads  # the tile's reduced fp32 gradient (a view)
        self.weights = weights  # where its new compute-dtype weights go (a view)
        self.pipeline_read = pipeline_read
        self.pipeline_write = pipeline_write
        self.steps = [0] * groups  # optimizer steps taken, per param group
        self.params: list[torch.nn.Parameter] = []  # rule without update: the masters as the optimizer's params
        if split_masters is not None and (masters is not None or codecs is None or rule.update is None):
            raise ConfigError("split masters need bf16 weights and the optimizer offloaded (its step runs on tiles)")
        self.current_weights = split_masters
        self._forget_weights = forget_weights
        self.splitter: MasterSplitter | None = None
        compact = codecs is not None and (split_masters is not None or any(c.name != "fp32" for c in codecs))
        self.codecs: list[StateCodec] | None = list(codecs) if compact else None
        if self.codecs is None:
            self.width = (0 if masters else 1) + len(rule.states)  # fp32 tensors per element in a segment
            for tile in tiles:
                manager.add(tile.name, tile.numel * self.width, home)
        else:
            if rule.update is None:
                raise ConfigError("compact optimizer states need the optimizer offloaded (its step runs on tiles)")
            master_width = 0 if masters else 0.5 if split_masters else 1
            self.width = master_width + sum(codec.bytes_per_element for codec in self.codecs) / 4
            widest = max((tile.numel for tile in tiles), default=0)
            decoded = sum(codec.name != "fp32" for codec in self.codecs)  # fp32 ones are stepped in place
            self._decoded = torch.empty(len(self.codecs) * widest if decoded else 0)  # the tile's states, in fp32
            if split_masters is not None:
                self.splitter = MasterSplitter(widest)  # before the segments: it sets their layout
            for tile in tiles:
                manager.add(tile.name, self._segment_bytes(tile.numel), home, torch.uint8)
            self._rounding = torch.Generator()  # the step's stochastic rounding, reseeded per tile and step

        manager.open()
        self._ahead: dict[int, SegmentHandle] = {}  # tile index -> read in flight or done
        self._grads_ahead: dict[int, SegmentHandle] = {}  # the same for swapped gradients
        self._run: _Run | None = None  # the step under way (begin_step .. end_step)
        self.finish_pending: Callable[[], None] | None = None  # while a deferred step is under way: finishes it

    def initialize(self, tile: Tile, master: torch.Tensor) -> None:
        """The tile's first value: ``master`` (fp32, its elements) and zero states."""

        def fill(segment: torch.Tensor) -> None:
            segment.zero_()  # zero states (compact ones too: zero bytes decode to zero)
            if self.splitter is not None:
                self.splitter.split(master, self._residual(tile, segment))
            elif self.masters is None:
                self._master(tile, segment).copy_(master)

        self.manager.initialize(tile.name, fill)

    def tiles_of(self, group: int, piece: int) -> list[Tile]:
        return [t for t in self.tiles if t.group == group and t.piece == piece]

    # ---- a segment's layout: [master | states], fp32, or the master's bytes (4 an element, or a split master's
    # residual: 2) then each state's stored bytes ----
    def _master_bytes(self, numel: int) -> int:
        if self.masters is not None:
            return 0
        return stored_master_bytes(numel, "split" if self.splitter is not None else "fp32")

    def _segment_bytes(self, numel: int) -> int:
        return self._master_bytes(numel) + sum(codec.stored_bytes(numel) for codec in self.codecs)

    def _residual(self, tile: Tile, segment: torch.Tensor) -> torch.Tensor:
        return segment[: 2 * tile.numel].view(torch.int16)

    def _master(self, tile: Tile, segment: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
        """The tile's fp32 master: a view of its segment or of the weights, or (split) joined from ``weights``
        (default: the current ones) into the splitter's workspace, valid until the next tile's is taken; a
        change to a joined master is kept by ``store_master``."""
        if self.masters is not None:
            return self.masters(tile)
        if self.splitter is not None:
            weights = self.current_weights(tile) if weights is None else weights
            return self.splitter.join(weights, self._residual(tile, segment))
        if self.codecs is None:
            return segment[: tile.numel]
        return segment[: 4 * tile.numel].view(torch.float32)

    def store_master(self, tile: Tile, segment: torch.Tensor, master: torch.Tensor,
                     weights: torch.Tensor | None = None) -> None:  # fmt: skip
        """A split master's residual <- ``master`` (changed in place; ``weights``: its bf16 rounding, just
        written); any other master is a view already."""
        if self.splitter is not None:
            self.splitter.split(master, self._residual(tile, segment), weights)

    def blank_master(self, tile: Tile, segment: torch.Tensor) -> torch.Tensor:
        """Where a caller that writes every element of a tile's master puts it (then ``store_master``): the
        segment's own master, or (split) the splitter's workspace, zeroed."""
        if self.splitter is not None:
            return self.splitter.master[: tile.numel].zero_()
        return self._master(tile, segment)

    @property
    def masters_transient(self) -> bool:
        """Whether ``_master`` gives a workspace the next tile reuses (split masters)."""
        return self.splitter is not None

    def _stored_states(self, tile: Tile, segment: torch.Tensor) -> list[torch.Tensor]:
        """Compact: each state's bytes within the segment."""
        start = self._master_bytes(tile.numel)
        parts = []
        for codec in self.codecs:
            size = codec.stored_bytes(tile.numel)
            parts.append(segment[start : start + size])
            start += size
        return parts

    def states_of(self, tile: Tile, segment: torch.Tensor) -> list[torch.Tensor]:
        """The tile's states in fp32: views of the segment, or (compact) decoded into the step's workspace, which
        ``store_states`` writes back; valid until the next tile's states are taken."""
        n = tile.numel
        if self.codecs is None:
            first = 0 if self.masters is not None else 1
            return [segment[(first + k) * n : (first + k + 1) * n] for k in range(len(self.rule.states))]
        states = []
        for k, (codec, stored) in enumerate(zip(self.codecs, self._stored_states(tile, segment), strict=True)):
            if codec.name == "fp32":  # beside a split master: the stored bytes are the state itself
                states.append(stored[: 4 * n].view(torch.float32))
                continue
            states.append(self._decoded[k * n : (k + 1) * n])
            codec.decode(stored, states[-1])
        return states

    def store_states(self, tile: Tile, segment: torch.Tensor, states: list[torch.Tensor], *,
                     step: int | None = None) -> None:  # fmt: skip
        """Compact: ``states`` (from states_of, updated) encoded back into the segment; views need nothing.
        ``step``: the optimizer step that updated them, which rounds stochastically, seeded by tile and step
        ([Note: compact states]); None rounds to nearest."""
        if self.codecs is None:
            return
        generator = None
        if step is not None:
            generator = self._rounding
            generator.manual_seed((tile.index << 24) + step)
        for codec, stored, values in zip(self.codecs, self._stored_states(tile, segment), states, strict=True):
            if codec.name != "fp32":  # an fp32 state was changed in place (states_of)
                codec.encode(values, stored, generator)

    def prefetch(self, order: Sequence[Tile] | None = None, *, gradients: bool = True) -> None:
        """Start reading the first tiles of the step (``order``: the order it will take them in; default the
        tiles' own), as many as free buffers allow, never blocking. Without ``gradients``: not their swapped
        gradients (from the start of backward, which is still writing them)."""
        if self.pipeline_read:
            tiles = self.tiles if order is None else order
            count = self.manager.buffer_count - (1 if gradients else 0)  # backward's start: nothing else is moving
            self._read_ahead(tiles, count, block=False, gradients=gradients)

    def _read_ahead(self, tiles: Sequence[Tile], count: int, *, block: bool, gradients: bool = True) -> None:
        """Reads of the first ``count`` of ``tiles`` (and their swapped gradients) started, as far as buffers go
        (``block``: waiting for one)."""
        for tile in tiles[:count]:
            index = tile.index
            if index not in self._ahead:
                handle = self.manager.acquire(tile.name, block=block)
                if handle is None:
                    return
                self._ahead[index] = handle
            if gradients and self.gradients is not None and index not in self._grads_ahead:
                handle = self.gradients.acquire(tile, block=block)
                if handle is None:
                    return
                self._grads_ahead[index] = handle

    def as_parameters(self) -> list[torch.nn.Parameter]:
        """For a rule without update: each tile's master as a parameter sharing its memory (homes in memory)."""
        self.params = [torch.nn.Parameter(self._master(t, self.manager.acquire(t.name).tensor)) for t in self.tiles]
        return self.params

    def step(self, param_groups: list[dict], on_tile: Callable[[Tile], None] | None = None, optimizer=None, *,
             grad_factors: Sequence[float] = ()) -> None:  # fmt: skip
        """One optimizer step over every tile; ``on_tile(tile)`` after each tile's weights are published.
        ``grad_factors``: swapped gradients are multiplied by these in turn first (unscale, clip), as in-memory
        ones were before the step."""
        if self.rule.update is None:
            self._step_with(optimizer, on_tile)
            return
        self.begin_step(param_groups, grad_factors)
        self.step_tiles(self.tiles, on_tile)
        self.end_step()

    def begin_step(self, param_groups: list[dict], grad_factors: Sequence[float] = (), *,
                   order: Sequence[Tile] | None = None, deferred: bool = False) -> None:  # fmt: skip
        """Starts a step whose tiles ``step_tiles`` then steps, in any grouping, each once, before ``end_step``.
        ``order``: the order the tiles are expected in (reads run ahead along it). ``deferred``: the tiles are
        stepped later than this call (behind the next forward: [Note: step behind forward] in
        unit_optimizer.py), so the hyperparameters are copied now: a scheduler stepping in between changes the
        next step's, not this one's."""
        if self.rule.stepper is not None:
            self.rule.stepper.begin()  # nothing left over from a step that failed part way
        order = list(self.tiles if order is None else order)
        groups = [{key: _snapshot(value) for key, value in group.items()} for group in param_groups] if deferred \
            else param_groups
        self._run = _Run(groups, tuple(grad_factors), order, {tile.index: k for k, tile in enumerate(order)})

    def step_tiles(self, tiles: Sequence[Tile], on_tile: Callable[[Tile], None] | None = None) -> None:
        """Steps ``tiles`` (of the step ``begin_step`` started), reading the run's next ones ahead."""
        run = self._run
        depth = max(self.manager.buffer_count - 2, 1) if self.pipeline_read else 1
        for tile in tiles:
            if tile.index in run.stepped:  # stepped before a failure part way through ``tiles``
                continue
            if tile.index not in self._ahead and self._ahead_full():
                self._release_ahead()  # read for tiles taken out of the expected order: the buffers are needed
            self._read_ahead([tile], 1, block=True)
            handle = self._ahead.pop(tile.index)
            grad_handle = self._grads_ahead.pop(tile.index, None)
            try:
                if self.pipeline_read:
                    self._read_ahead(run.following(tile, depth), depth, block=False)
                self._step_tile(tile, handle.wait(), grad_handle, run)
            except BaseException:
                _give_back(self.manager.release, handle)  # clean: the tile steps again from its stored values
                if grad_handle is not None:
                    _give_back(self.gradients.manager.release, grad_handle)
                raise
            self.manager.release(handle, dirty=True)
            run.stepped.add(tile.index)
            if grad_handle is not None:
                self.gradients.release(grad_handle)
            if not self.pipeline_write:
                self.manager.flush()
            if on_tile is not None:
                on_tile(tile)

    def _step_tile(self, tile: Tile, segment: torch.Tensor, grad_handle: SegmentHandle | None, run: _Run) -> None:
        weights = self.weights(tile) if self.masters is None else None
        master = self._master(tile, segment, weights)
        states = self.states_of(tile, segment)
        if grad_handle is not None:
            grad = self.gradients.values(grad_handle)
            for factor in run.grad_factors:
                grad.mul_(factor)
        else:
            grad = self.grads(tile)
            grad = grad if grad.device == master.device else grad.to(master.device)
        self.rule.update(run.groups[tile.group], master, grad, states, self.steps[tile.group])
        self.store_states(tile, segment, states, step=self.steps[tile.group])
        if weights is not None:
            weights.copy_(master)
            self.store_master(tile, segment, master, weights)

    def _ahead_full(self) -> bool:
        """Whether reads ahead hold every buffer but one of a ring (the tile about to be taken needs that one)."""
        if len(self._ahead) >= self.manager.buffer_count - 1:
            return True
        return self.gradients is not None and len(self._grads_ahead) >= self.gradients.manager.buffer_count - 1

    def abandon_step(self) -> None:
        """A step begun and not finished is forgotten, uncounted (a load replaces the tiles next)."""
        self._run = None
        self._release_ahead()

    def end_step(self) -> None:
        """Every tile of the step was stepped: the step counts."""
        for group in range(len(self.steps)):
            self.steps[group] += 1
        self._run = None
        if self.rule.stepper is not None:
            self.rule.stepper.finish()

    def _step_with(self, optimizer: torch.optim.Optimizer, on_tile) -> None:
        """The user's optimizer on every tile at once. The weights are taken tile by tile afterwards, so
        ``on_tile`` can write a unit's offloaded piece back before the next unit's is read."""
        for tile, param in zip(self.tiles, self.params, strict=True):
            param.grad = self.grads(tile)
        optimizer.step()
        for tile, param in zip(self.tiles, self.params, strict=True):
            param.grad = None
            if self.masters is None:
                self.weights(tile).copy_(param.detach())
            if on_tile is not None:
                on_tile(tile)

    def read_masters(self, into: Callable[[Tile], torch.Tensor]) -> None:
        """Copies every tile's master into ``into(tile)`` (an fp32 view): for checkpoints and tests."""
        self._visit(lambda tile, master: into(tile).copy_(master), dirty=False)

    def edit_masters(self, tiles: list[Tile], edit: Callable[[Tile, torch.Tensor], None],
                     weights: Callable[[Tile], torch.Tensor] | None = None) -> None:  # fmt: skip
        """``edit(tile, master)`` changes the masters of ``tiles`` in place (edited weights); no other tile is
        read. ``weights``: the tiles' weights where the caller has them (split masters join with them)."""
        self._visit(edit, dirty=True, tiles=tiles, weights=weights)

    def _visit(self, fn, *, dirty: bool, tiles: list[Tile] | None = None,
               weights: Callable[[Tile], torch.Tensor] | None = None) -> None:  # fmt: skip
        """``fn(tile, master)`` on each tile; ``weights``: where a split master's weights are, if not the
        current ones."""
        self.drop_ahead()
        try:
            for tile in self.tiles if tiles is None else tiles:
                handle = self.manager.acquire(tile.name)
                try:
                    segment = handle.wait()
                    master = self._master(tile, segment, None if weights is None else weights(tile))
                    fn(tile, master)
                    if dirty:
                        self.store_master(tile, segment, master)
                finally:
                    self.manager.release(handle, dirty=dirty)
        finally:
            self.end_visit()
        self.manager.flush()

    def end_visit(self) -> None:
        """A visit of the tiles outside the step ended: a copy of the weights taken to join masters goes (the
        pieces may change before the next one)."""
        if self._forget_weights is not None:
            self._forget_weights()

    def drop_ahead(self) -> None:
        """Before the tiles are visited outside the step: a step still under way finishes first (``finish_pending``,
        set by a deferred step's owner), and reads started ahead let go of their buffers."""
        if self.finish_pending is not None:
            self.finish_pending()
        self._release_ahead()

    def _release_ahead(self) -> None:
        for handle in self._ahead.values():
            self.manager.release(handle, dirty=False)
        self._ahead.clear()
        self.drop_gradients_ahead()

    def drop_gradients_ahead(self) -> None:
        """Gradients read ahead for a step that did not happen (fp16 overflow) are stale in the next window."""
        for handle in self._grads_ahead.values():
            self.gradients.release(handle)
        self._grads_ahead.clear()

    def state_bytes(self) -> int:
        if self.codecs is not None:
            return sum(self._segment_bytes(tile.numel) for tile in self.tiles)
        return sum(tile.numel * self.width * 4 for tile in self.tiles)

    def close(self) -> None:
        try:
            self._release_ahead()
        finally:
            try:
                self.manager.close()
            finally:
                if self.gradients is not None:
                    self.gradients.close()
